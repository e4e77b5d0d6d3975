"""Evaluation: metrics, LLM evaluators, run comparisons and synthetic-data scores.

Metrics (:mod:`fedfm.eval.metrics`), LLM evaluators (:mod:`fedfm.eval.llm`), run comparisons
(:mod:`fedfm.eval.compare`) and synthetic-data evaluation (:mod:`fedfm.eval.synthetic`).

Generation itself is a model operation (:mod:`fedfm.models.generation`), below this package.
"""
