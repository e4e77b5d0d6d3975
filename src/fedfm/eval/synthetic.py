"""How good a synthetic text set is: downstream classifiers on real held-out data, and a distance.

The utility of a DP synthetic set (Yue et al. 2023; the resource-adaptive federated variant of
:mod:`fedfm.algorithms.dpsyn`) is what a classifier trained **only on synthetic texts** scores
on the **real** held-out set. Two classifiers:

* ``logreg``: logistic regression (scikit-learn) on sentence embeddings (MiniLM by default);
* ``clf``: fedfm's small text classifier (the task's ``model``, hashed n-grams, Joulin et al.
  2017) trained with Adam.

Both report accuracy and macro-F1. ``frechet``: the Fréchet distance between Gaussians fitted to
the synthetic and the real held-out embeddings (the FID formula of Heusel et al. 2017 on
sentence embeddings): ``‖μ_s − μ_r‖² + Tr(Σ_s + Σ_r − 2 (Σ_s Σ_r)^{1/2})``. References: the same
classifiers trained on the real training data (the ceiling).

Choices of ours: logistic regression with ``C = 1`` and lbfgs (scikit-learn's defaults) on
L2-normalised embeddings; a training set with a single class predicts that class; the text
classifier's budget is ``clf_steps`` Adam steps of batch 32 at lr 0.01, seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedfm.config import TrainConfig
from fedfm.eval.metrics import tensor_macro_f1 as macro_f1
from fedfm.models.encoders import known_encoder


class SyntheticEvalConfig(BaseModel):
    """Evaluation of a synthetic set (``algo.eval``).

    Attributes:
        enabled: Evaluate after generation and after voting.
        embedder: Embedder of ``logreg`` and ``frechet`` (``None``: the algorithm's).
        logreg_c: Inverse regularisation strength of the logistic regression.
        clf: Also train the task's small text classifier.
        clf_steps: Its Adam steps.
        clf_lr: Its learning rate.
        clf_batch_size: Its batch size.
        references: Also report the classifiers trained on the real training data
            (``real/...``, once).
        floor: Also generate the same allotment with the un-fine-tuned base model and report
            its scores (``floor/...``, once).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    embedder: str | None = None
    logreg_c: float = Field(1.0, gt=0)
    clf: bool = True
    clf_steps: int = Field(200, ge=1)
    clf_lr: float = Field(0.01, gt=0)
    clf_batch_size: int = Field(32, ge=1)
    references: bool = True
    floor: bool = False

    @field_validator("embedder")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        return None if v is None else known_encoder(v, "texts", unit_norm=True)


def logreg_predict(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, c: float = 1.0
) -> np.ndarray:
    """``(m,)`` predicted classes of ``test_x`` by a logistic regression fitted on ``train``.

    Args:
        train_x: ``(n, d)`` features.
        train_y: ``(n,)`` class indices.
        test_x: ``(m, d)`` features.
        c: Inverse regularisation strength.
    """
    from sklearn.linear_model import LogisticRegression

    classes = np.unique(train_y)
    if len(classes) == 1:
        return np.full(len(test_x), classes[0])
    model = LogisticRegression(C=c, max_iter=1000)
    return np.asarray(model.fit(train_x, train_y).predict(test_x))


def logreg_scores(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, c: float = 1.0
) -> dict[str, float]:
    """Accuracy and macro-F1 of a logistic regression fitted on ``train``.

    Scored on ``test``; the arguments are those of :func:`logreg_predict`, ``test_y`` the ``(m,)``
    true classes.
    """
    return scores(logreg_predict(train_x, train_y, test_x, c), test_y)


def scores(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1 of predicted classes ``pred`` against ``y`` (both ``(m,)``)."""
    p, t = torch.as_tensor(np.asarray(pred, np.int64)), torch.as_tensor(np.asarray(y, np.int64))
    return {"acc": float((p == t).float().mean()), "macro_f1": macro_f1(p, t)}


def classifier_predict(
    task: Any, texts: Sequence[str], labels: Sequence[int], cfg: SyntheticEvalConfig, seed: int
) -> np.ndarray:
    """Predictions of the task's text classifier trained on ``texts``.

    ``(m,)`` predicted classes on the task's real test set of its text classifier trained
    on ``texts`` (the task must provide ``labelled`` and its classification API).
    """
    from fedfm.core.train import local_train

    data = task.labelled(list(texts), list(labels))
    model = task.build_model(seed=seed)
    train = TrainConfig(
        steps=cfg.clf_steps, batch_size=cfg.clf_batch_size, optimizer="adam", lr=cfg.clf_lr
    )
    local_train(model, task.batches(data, train.batch_size, seed), task.loss, train, train.steps)
    return task.predict(model, task.test_data()).argmax(-1).numpy()


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to the rows of ``a`` and ``b``.

    Fréchet distance between Gaussians fitted to the rows of ``a`` ``(n, d)`` and ``b``
    ``(m, d)`` (sample covariances).

    ``Tr((Σ_a Σ_b)^{1/2})`` is the sum of the square roots of the eigenvalues of ``Σ_a Σ_b``,
    which are real and non-negative (the product of two PSD matrices is similar to a PSD
    one), so no matrix square root is formed: faster than ``scipy.linalg.sqrtm`` and stable
    when the covariances are singular (fewer samples than dimensions).
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a = np.atleast_2d(np.cov(a, rowvar=False))
    cov_b = np.atleast_2d(np.cov(b, rowvar=False))
    eig = np.linalg.eigvals(cov_a @ cov_b)
    tr_root = float(np.sqrt(np.clip(eig.real, 0.0, None)).sum())
    value = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * tr_root)
    return max(value, 0.0)


def synthetic_scores(
    task: Any,
    texts: Sequence[str],
    labels: Sequence[int | None],
    embed: Any,
    test_emb: np.ndarray,
    cfg: SyntheticEvalConfig,
    seed: int,
    predictions: dict[str, np.ndarray] | None = None,
) -> dict[str, float]:
    """Every score of one synthetic set against the task's real held-out set.

    Args:
        task: A text task with ``labelled``, ``test_data`` and its classifier.
        texts: Synthetic texts.
        labels: Their class labels (``None`` for all: only the distance is computed).
        embed: Texts -> L2-normalised embeddings.
        test_emb: Embeddings of the real held-out texts.
        cfg: What to compute.
        seed: Seeds the text classifier.
        predictions: When given, receives each classifier's ``(m,)`` predicted classes on
            the held-out set (``logreg``, ``clf``), for paired comparisons over test items.

    Returns:
        ``acc`` and ``macro_f1`` (logistic regression on embeddings), ``clf/acc`` and
        ``clf/macro_f1`` (the text classifier), ``frechet``, ``n``.
    """
    out: dict[str, float] = {"n": float(len(texts))}
    if not texts:
        return out
    emb = embed(list(texts))
    if len(texts) > 1:
        out["frechet"] = frechet_distance(emb, test_emb)
    if any(y is None for y in labels):
        return out
    y = np.asarray(labels, dtype=np.int64)
    test_y = task.test_data().y.numpy()
    preds = {"logreg": logreg_predict(emb, y, test_emb, cfg.logreg_c)}
    out.update(scores(preds["logreg"], test_y))
    if cfg.clf:
        preds["clf"] = classifier_predict(task, texts, [int(v) for v in y], cfg, seed)
        out.update({f"clf/{k}": v for k, v in scores(preds["clf"], test_y).items()})
    if predictions is not None:
        predictions.update(preds)
    return out
