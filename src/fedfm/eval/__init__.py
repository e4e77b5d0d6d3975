"""Metrics (:mod:`fedfm.eval.metrics`), generation (:mod:`fedfm.eval.generate`) and LLM evaluators
(:mod:`fedfm.eval.llm`)."""
