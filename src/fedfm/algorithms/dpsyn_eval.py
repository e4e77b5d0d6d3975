"""dpsyn's evaluation of a synthetic set: classifiers trained on it, tested on real rows.

:mod:`fedfm.algorithms.dpsyn` scores its set after generation and after voting, beside the
ceiling (the same classifiers on every client's real training rows) and the floor (the base
model's samples); :func:`fedfm.eval.synthetic.synthetic_scores` trains and tests the
classifiers. Each scored set keeps every classifier's prediction per held-out row, so that a
study pairs two sets over the same test rows (``eval_items.jsonl``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedfm.core.seeding import derive_seed
from fedfm.eval.synthetic import SyntheticEvalConfig, synthetic_scores
from fedfm.models.encoders import text_embedder
from fedfm.tasks.base import Task, TextView, capable

Predictions = dict[str, dict[str, np.ndarray]]
"""Scored set (``gen``, ``vote``, ``real``, ``floor``) -> classifier -> prediction per test row."""


class SyntheticScorer:
    """Scores sets of rows (``text``, ``label``) on the task's real held-out rows.

    Args:
        task: The task (its test rows, its clients' rows, its device).
        cfg: The evaluation settings (``algo.eval``).
        embedder: The sentence embedder when ``cfg.embedder`` is not set (``algo.embedder``).
        seed: The run seed (each set's classifiers are seeded by it and the set's name).
    """

    def __init__(self, task: Task, cfg: SyntheticEvalConfig, embedder: str, seed: int) -> None:
        self.task = task
        self.cfg = cfg
        self.embedder = embedder
        self.seed = seed
        self._test_emb: np.ndarray | None = None

    def embed(self) -> Any:
        """The evaluation's sentence embedder."""
        return text_embedder(self.cfg.embedder or self.embedder, self.task.device)

    def test_embeddings(self) -> np.ndarray:
        """The held-out rows' embeddings, computed once."""
        if self._test_emb is None:
            self._test_emb = self.embed()(capable(self.task, TextView).texts(self.task.test_data()))
        return self._test_emb

    def scores(
        self, rows: list[dict[str, Any]], purpose: str, preds: Predictions | None = None
    ) -> dict[str, float]:
        """The scores of a set of rows; its predictions go to ``preds[purpose]``."""
        texts = [row["text"] for row in rows]
        return self._score(texts, [row["label"] for row in rows], purpose, preds)

    def references(self, preds: Predictions | None = None) -> dict[str, float]:
        """The ceiling: the same classifiers trained on every client's real training rows."""
        texts: list[str] = []
        labels: list[int] = []
        for cid in self.task.client_ids():
            data = self.task.client_data(cid)
            texts += capable(self.task, TextView).texts(data)
            labels += [int(y) for y in data.y]
        return {f"real/{k}": v for k, v in self._score(texts, labels, "real", preds).items()}

    def _score(
        self, texts: list[str], labels: list[Any], purpose: str, preds: Predictions | None
    ) -> dict[str, float]:
        got: dict[str, np.ndarray] = {}
        out = synthetic_scores(
            self.task,
            texts,
            labels,
            self.embed(),
            self.test_embeddings(),
            self.cfg,
            derive_seed(self.seed, "eval", purpose),
            got,
        )
        if preds is not None and got:
            preds[purpose] = got
        return out

    def items(self, preds: Predictions) -> list[dict[str, Any]]:
        """One item per (set, real held-out row): its label and each classifier's prediction.

        ``set`` is ``gen``, ``vote``, ``real`` or ``floor``; ``id`` the row's source id. They
        let a study pair two sets' scores over the same test rows.
        """
        test = self.task.test_data()
        ids, ys = test.ids.tolist(), test.y.tolist()
        out = []
        for name, by_clf in preds.items():
            for i, (sid, y) in enumerate(zip(ids, ys, strict=True)):
                item: dict[str, Any] = {"id": int(sid), "set": name, "y": int(y)}
                item.update({clf: int(p[i]) for clf, p in by_clf.items()})
                out.append(item)
        return out
