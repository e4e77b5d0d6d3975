"""The studies' classifier instrument and stated power, checked by hand: balanced accuracy
and macro-F1 (scikit-learn's), balanced accuracy as a weighted item mean, and the minimum
detectable effect at 2 SE."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedfm.reproduce.stats import (
    Estimate,
    balanced_accuracy,
    balanced_weights,
    macro_f1,
    mde,
    mde_of,
    paired,
    units_for,
)

Y = ["ham", "ham", "ham", "spam"]


def test_balanced_accuracy_and_macro_f1_by_hand() -> None:
    pred = ["ham", "ham", "spam", "spam"]
    # recall: ham 2/3, spam 1/1 -> 5/6
    assert balanced_accuracy(Y, pred) == pytest.approx(5 / 6)
    # F1: ham 2·2/(2·2 + 0 + 1) = 4/5, spam 2·1/(2·1 + 1 + 0) = 2/3 -> 11/15
    assert macro_f1(Y, pred) == pytest.approx(11 / 15)


def test_a_majority_answer_scores_chance_in_the_balanced_metrics() -> None:
    pred = ["ham"] * 4
    assert np.mean([a == b for a, b in zip(Y, pred, strict=True)]) == 0.75
    assert balanced_accuracy(Y, pred) == pytest.approx(0.5)
    # ham: tp 3, fp 1, fn 0 -> 6/7; spam never predicted -> 0
    assert macro_f1(Y, pred) == pytest.approx(3 / 7)


def test_an_off_label_answer_is_a_miss_of_its_true_class() -> None:
    pred = ["ham", "ham", "unsure", "spam"]
    # recall over the true classes only: ham 2/3, spam 1
    assert balanced_accuracy(Y, pred) == pytest.approx(5 / 6)
    # F1 over the gold classes only: ham (tp 2, fp 0, fn 1) 4/5, spam (tp 1) 1; "unsure" is
    # an error of its ham item, not a class of its own (that would add an F1 of 0: 0.6)
    assert macro_f1(Y, pred) == pytest.approx((4 / 5 + 1) / 2)


def test_one_macro_f1_in_the_studies_and_the_evaluator() -> None:
    """The studies' metrics are the evaluator's: scikit-learn's with labels = the gold classes."""
    from sklearn.metrics import f1_score

    from fedfm.eval.metrics import class_balanced_scores

    y = ["ham", "spam", "spam", "ham", "ham"]
    pred = ["(none)", "spam", "ham", "ham", "spam"]
    # ham: tp 1, fp 1, fn 2 -> 2/5; spam: tp 1, fp 1, fn 1 -> 2/4; "(none)" is a ham miss
    assert macro_f1(y, pred) == pytest.approx((2 / 5 + 2 / 4) / 2)
    got = class_balanced_scores(y, pred)
    assert (
        macro_f1(y, pred)
        == got["f1_macro"]
        == pytest.approx(
            f1_score(y, pred, labels=["ham", "spam"], average="macro", zero_division=0)
        )
    )
    # recall: ham 1/3, spam 1/2
    assert balanced_accuracy(y, pred) == got["bal_acc"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert math.isnan(macro_f1([], [])) and math.isnan(balanced_accuracy([], []))


def test_balanced_accuracy_is_the_weighted_mean_of_the_items_correctness() -> None:
    w = balanced_weights(Y)  # N / (C · n_c): 4 / 6 for ham, 4 / 2 for spam
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    a = ["ham", "ham", "spam", "spam"]
    b = ["ham"] * 4
    ca = {i: float(p == t) * w[i] for i, (p, t) in enumerate(zip(a, Y, strict=True))}
    cb = {i: float(p == t) * w[i] for i, (p, t) in enumerate(zip(b, Y, strict=True))}
    assert np.mean(list(ca.values())) == pytest.approx(balanced_accuracy(Y, a))
    d = paired(ca, cb)  # item differences: 0, 0, -2/3, +2
    assert d.mean == pytest.approx(5 / 6 - 1 / 2)
    sd = np.std([0, 0, -2 / 3, 2], ddof=1)
    assert d.se == pytest.approx(sd / 2)


def test_the_minimum_detectable_effect_is_two_se_from_the_items_and_their_sd() -> None:
    # 87 items of per-item SD 0.140: 2 · 0.14 / √87 = 0.0300
    assert mde(0.14, 87) == pytest.approx(0.030019, abs=1e-6)
    # the paper's FedHDS - Random margin of 0.01 at SD 0.1 needs (2 · 0.1 / 0.01)² = 400 items
    assert mde(0.1, 400) == pytest.approx(0.01)
    assert mde(0.1, 399) > 0.01
    d = paired({1: 0.3, 2: 0.1, 3: 0.2}, {1: 0.0, 2: 0.0, 3: 0.0})
    assert mde_of(d) == pytest.approx(mde(0.1, 3)) == pytest.approx(2 * 0.1 / math.sqrt(3))
    assert math.isnan(mde_of(Estimate(0.5, math.nan, 1)))
    assert math.isnan(mde(0.1, 1))
    # FedHDS - Random: the paper's 0.0041 Rouge-L at SD 0.10 needs (0.2 / 0.0041)² = 2380 items
    assert units_for(0.10, 0.0041) == math.ceil((0.2 / 0.0041) ** 2) == 2380
    assert mde(0.10, units_for(0.10, 0.0041)) <= 0.0041 < mde(0.10, 2379)
