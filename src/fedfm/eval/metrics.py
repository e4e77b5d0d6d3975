"""Metrics for generated text and predictions: pure functions that can be checked by hand.

Sources:
    * ROUGE-L: Lin (2004), "ROUGE: A Package for Automatic Evaluation of Summaries", computed with
      Google's ``rouge-score`` package (F-measure of the longest common subsequence). Stemming is
      **on** (``use_stemmer=True``, Porter stemmer, as ROUGE-1.5.5 ``-m``), so "jumps"/"jumped"
      match. rouge-score's tokenizer lowercases and keeps only ``[a-z0-9]`` runs, so text in
      other scripts scores 0.
    * Exact match: the SQuAD v1.1 evaluation script (Rajpurkar et al., 2016): lowercase, drop
      punctuation, drop the articles a/an/the, collapse whitespace.
    * GSM8K answers: Cobbe et al. (2021) write the final answer after ``####``.
    * Macro-F1, accuracy and RMSE come from scikit-learn.
"""

from __future__ import annotations

import math
import re
import string
import warnings
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn import metrics as skm

from fedfm.errors import FedfmError
from fedfm.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

METRICS: Registry[Callable[[Sequence, Sequence], float]] = Registry("metric", "eval.metrics")
"""Prediction metrics ``f(y_true, y_pred) -> float`` selectable by name in configs."""


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:  # rouge_score ships no type hints
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure of ``prediction`` against ``reference`` (stemmed, in [0, 1]).

    With LCS length ``l``, ``P = l / len(pred)``, ``R = l / len(ref)`` and ``F = 2PR / (P + R)``.
    An empty prediction or reference scores 0.
    """
    return float(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure)


def mean_rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F-measure over pairs."""
    _check_pairs(predictions, references)
    return float(np.mean([rouge_l(p, r) for p, r in zip(predictions, references, strict=True)]))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the SQuAD-normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def _choice_words(text: str) -> str:
    # Lighter than SQuAD normalisation: articles stay, since "A"/"B" are common choice labels.
    text = re.sub(rf"[{re.escape(string.punctuation)}]", " ", text.lower())
    return " ".join(text.split())


def pick_choice(prediction: str, choices: Sequence[str]) -> int | None:
    """Index of the choice that a generation names, or ``None`` when it names none.

    Text is lowercased, punctuation becomes spaces and whitespace is collapsed; a choice matches
    where its words occur as whole words. The choice occurring first wins; two choices starting at
    the same position (one a prefix of the other, e.g. "no" and "no change") resolve to the longer.
    """
    text = f" {_choice_words(prediction)} "
    best: tuple[int, int] | None = None  # (position, -length)
    best_idx = None
    for idx, choice in enumerate(choices):
        words = _choice_words(choice)
        if not words:
            continue
        pos = text.find(f" {words} ")
        if pos < 0:
            continue
        key = (pos, -len(words))
        if best is None or key < best:
            best, best_idx = key, idx
    return best_idx


def resolve_answer(answer: str | int, choices: Sequence[str]) -> int:
    """Index of the correct choice: ``answer`` is an index or one of the choices' texts.

    Raises:
        FedfmError: ``answer`` names no choice.
    """
    if isinstance(answer, int | np.integer) and not isinstance(answer, bool):
        if 0 <= int(answer) < len(choices):
            return int(answer)
    else:
        target = _choice_words(str(answer))
        for idx, choice in enumerate(choices):
            if _choice_words(choice) == target:
                return idx
    raise FedfmError(f"answer {answer!r} is not one of the choices {list(choices)}")


def choice_accuracy(prediction: str, choices: Sequence[str], answer: str | int) -> int:
    """1 when the choice named first in ``prediction`` (see :func:`pick_choice`) is the answer."""
    return int(pick_choice(prediction, choices) == resolve_answer(answer, choices))


# A minus sign counts only when no word character precedes it ("3-4" is a range, not -4).
_NUMBER = re.compile(r"(?:(?<!\w)-)?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _canonical_number(token: str) -> str | None:
    cleaned = token.replace(",", "").replace("$", "").replace(" ", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    text = format(value, "f")
    if "." in text:  # "3.0" -> "3", "18.50" -> "18.5"
        text = text.rstrip("0").rstrip(".")
    return "0" if text in {"-0", ""} else text


def gsm8k_number(text: str, finished: bool = True) -> str | None:
    """The final numeric answer in ``text`` as a canonical string, or ``None``.

    The first number after the last ``####`` is preferred; otherwise the last number in the text,
    but only when the text is ``finished``: a reply cut by its token budget before a ``####``
    answer has no final number (its last number is an intermediate step, not an answer).
    Thousands commas and ``$`` are removed and trailing decimal zeros dropped
    (``"#### 1,234"`` → ``"1234"``, ``"The answer is $18."`` → ``"18"``, ``"3.0"`` → ``"3"``).
    """
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return _canonical_number(found[0])
    if not finished:
        return None
    found = _NUMBER.findall(text)
    return _canonical_number(found[-1]) if found else None


def gsm8k_correct(prediction: str, answer: str | int | float, finished: bool = True) -> bool:
    """Whether the final number of ``prediction`` equals the answer's final number.

    ``finished=False`` (the reply ran into its token budget) accepts only a ``####`` answer
    (see :func:`gsm8k_number`).
    """
    pred = gsm8k_number(prediction, finished)
    ref = gsm8k_number(str(answer))
    return pred is not None and pred == ref


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """``exp(nll_sum / n_tokens)``: the perplexity of a summed natural-log NLL."""
    if n_tokens <= 0:
        raise FedfmError(f"perplexity needs at least one token, got n_tokens={n_tokens}")
    return float(math.exp(nll_sum / n_tokens))


def _check_pairs(y_true: Sequence, y_pred: Sequence) -> None:
    if len(y_true) != len(y_pred):
        raise FedfmError(f"metric inputs differ in length: {len(y_true)} vs {len(y_pred)}")
    if len(y_true) == 0:
        raise FedfmError("metric inputs are empty")


@METRICS.register("accuracy", help="fraction of exact label matches")
def accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Fraction of predictions equal to the labels."""
    _check_pairs(y_true, y_pred)
    return float(skm.accuracy_score(y_true, y_pred))


@METRICS.register("macro_f1", help="unweighted mean of per-class F1")
def macro_f1(y_true: Sequence, y_pred: Sequence) -> float:
    """Unweighted mean of per-class F1 over the classes present in either input.

    A class with no predicted and no true positive gets F1 0 (``zero_division=0``).
    """
    _check_pairs(y_true, y_pred)
    return float(skm.f1_score(y_true, y_pred, average="macro", zero_division=0))


@METRICS.register("balanced_acc", help="mean per-class recall over the true classes")
def balanced_accuracy(y_true: Sequence, y_pred: Sequence) -> float:
    """Mean recall over the classes of ``y_true``.

    Always answering one class scores 1 / (number of true classes), however frequent that class is.
    """
    return class_balanced_scores(y_true, y_pred)["bal_acc"]


def class_balanced_scores(y_true: Sequence, y_pred: Sequence) -> dict[str, float]:
    """The classification readouts a majority-class answer cannot win, from scikit-learn.

    ``bal_acc``: ``balanced_accuracy_score`` (mean recall over the classes of ``y_true``);
    ``f1_macro``: ``f1_score(average="macro", labels=<classes of y_true>, zero_division=0)``,
    so an answer outside the true classes (another label, no label) only costs recall;
    ``bal_acc_se``: its standard error, ``sqrt(sum_c r_c (1 - r_c) / n_c) / C`` with ``r_c``
    the recall of class ``c`` over its ``n_c`` items (ours: each class's recall a binomial
    proportion, the classes independent).

    The one definition of both for answers that may fall outside the gold labels: the
    reproduction studies' ``balanced_accuracy`` and ``macro_f1`` call this function. (The
    registered ``macro_f1`` and :func:`tensor_macro_f1` score closed-set classifiers, whose
    every prediction is a class, over the classes of either input.)
    """
    _check_pairs(y_true, y_pred)
    classes = sorted({str(y) for y in y_true})
    true, pred = [str(y) for y in y_true], [str(y) for y in y_pred]
    with warnings.catch_warnings():  # "y_pred contains classes not in y_true": counted wrong
        warnings.simplefilter("ignore", UserWarning)
        bal = float(skm.balanced_accuracy_score(true, pred))
    f1 = float(skm.f1_score(true, pred, labels=classes, average="macro", zero_division=0))
    recall = skm.recall_score(true, pred, labels=classes, average=None, zero_division=0)
    counts = [true.count(c) for c in classes]
    var = sum(r * (1 - r) / n for r, n in zip(recall, counts, strict=True))
    return {"bal_acc": bal, "f1_macro": f1, "bal_acc_se": math.sqrt(var) / len(classes)}


@METRICS.register("rmse", help="root mean squared error (regression)")
def rmse(y_true: Sequence[float], y_pred: Sequence[float]) -> float:
    """Root mean squared error."""
    _check_pairs(y_true, y_pred)
    return float(skm.root_mean_squared_error(y_true, y_pred))


def tensor_macro_f1(pred: Tensor, y: Tensor) -> float:
    """Macro-F1: the unweighted mean of per-class F1.

    Unweighted mean of per-class F1 = 2·TP / (2·TP + FP + FN) over the classes present in
    ``y`` or ``pred`` (both ``[N]`` class indices).

    Equal to ``sklearn.metrics.f1_score(y, pred, average="macro", zero_division=0)`` (tested);
    written out because sklearn validates its inputs on every call (about 4 ms), which
    dominated the evaluation of small models evaluated on every client every few rounds.
    """
    import torch  # torch only for callers that have tensors (``fedfm report`` has none)

    labels = torch.unique(torch.cat([y, pred]))  # [L]
    is_pred = pred[:, None] == labels[None, :]  # [N, L]
    is_true = y[:, None] == labels[None, :]
    tp = (is_pred & is_true).sum(0).double()
    # Every label occurs in y or pred, so the denominator tp+fp + tp+fn is at least 1.
    f1 = 2 * tp / (is_pred.sum(0) + is_true.sum(0)).double()
    return float(f1.mean())
