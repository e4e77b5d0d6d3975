r"""Comparisons across runs and clients: head-to-head win rates and answer-distribution shifts.

* :func:`read_items` — the items a run evaluated (the engine keeps every evaluation's items in
  ``eval_items.jsonl``), one row per item of one evaluation round.
* :func:`win_rate_runs` — per held-out item, two runs' scores compared (wins, ties, losses; ties
  count half, :func:`fedfm.eval.llm.head_to_head`), with the standard error of the win rate.
* :func:`js_divergence` and :func:`tfidf_cosine` — how far apart clients' answer distributions
  are (FedSDR's analysis of raw vs distilled data: JS divergence down, TF-IDF cosine up).
* :func:`update_cosines` — pairwise cosine between clients' flattened updates;
  :class:`UpdateCosines` collects a round's updates on the server (``algo.update_cosines``).

Choices of ours (the FedSDR paper gives the figures, not the recipe):

* JS divergence: each client's answers become one unigram distribution over a shared
  vocabulary (lower-cased ``\w+`` tokens); the figure is the mean over client pairs of the
  Jensen-Shannon divergence in bits (0 = identical, 1 = disjoint).
* TF-IDF cosine: scikit-learn's ``TfidfVectorizer`` fitted on every answer of every client;
  a client is the mean of its answers' (L2-normalised) vectors; the figure is the mean over
  client pairs of the cosine between those centroids.
* Win-rate standard error: of the mean of per-item outcomes (1, 0.5, 0), ``sd / sqrt(n)``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedfm.core.runfolder import read_jsonl
from fedfm.errors import ConfigError, FedfmError
from fedfm.eval.llm import head_to_head

ITEMS = "eval_items.jsonl"
ITEM_KEYS = ("id", "domain", "metric", "zeroshot", "score", "answer", "reference")


def read_items(run_dir: Path, rnd: int | None = None) -> list[dict[str, Any]]:
    """The items a run evaluated in round ``rnd`` (its last evaluated round when ``None``).

    Raises:
        ConfigError: The run kept no items (field ``run``), or none of round ``rnd``.
    """
    path = run_dir / ITEMS
    if not path.exists():
        raise ConfigError("run", f"{run_dir} kept no evaluated items ({ITEMS})")
    rows = read_jsonl(path)  # one line per evaluation: {"round": r, "items": [...]}
    if not rows:
        raise ConfigError("run", f"{path} is empty")
    want = max(int(r["round"]) for r in rows) if rnd is None else rnd
    out = [{"round": want, **it} for r in rows if int(r["round"]) == want for it in r["items"]]
    if not out:
        raise ConfigError("run", f"{path} has no items of round {want}")
    return out


def win_rate(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Head-to-head of items ``a`` over items ``b`` (matched by id) with the win rate's SE.

    Returns:
        :func:`fedfm.eval.llm.head_to_head`'s ``wins, ties, losses, n, win_rate`` (and per
        domain) plus ``se``, the standard error of ``win_rate``.
    """
    out = head_to_head(a, b)
    n = out["n"]
    mean = out["win_rate"]
    # Outcomes are 1 (win), 0.5 (tie), 0 (loss); their sample variance gives the SE.
    sq = out["wins"] * (1 - mean) ** 2 + out["ties"] * (0.5 - mean) ** 2 + out["losses"] * mean**2
    out["se"] = math.sqrt(sq / (n - 1) / n) if n > 1 else 0.0
    return out


def win_rate_runs(run_a: Path, run_b: Path, rnd: int | None = None) -> dict[str, float]:
    """Win rate of run ``a`` over run ``b`` on the items both evaluated in their last round.

    Raises:
        ConfigError: A run kept no items.
        FedfmError: The runs share no item.
    """
    return win_rate(read_items(run_a, rnd), read_items(run_b, rnd))


def win_rate_table(run_dirs: Sequence[Path]) -> str | None:
    """A markdown table of each run's win rate over the first run.

    ``None`` when a run kept no items (``fedfm report`` prints the table below the metrics table).
    """
    try:
        items = [read_items(d) for d in run_dirs]
    except ConfigError:
        return None
    lines = ["| run | vs | wins | ties | losses | win rate (SE) |", "|---|---|---|---|---|---|"]
    for d, its in zip(run_dirs[1:], items[1:], strict=True):
        try:
            w = win_rate(its, items[0])
        except FedfmError:
            continue
        lines.append(
            f"| {d.name} | {run_dirs[0].name} | {w['wins']:.0f} | {w['ties']:.0f} |"
            f" {w['losses']:.0f} | {w['win_rate']:.3f} ({w['se']:.3f}) |"
        )
    return "\n".join(lines) if len(lines) > 2 else None


# ----------------------------------------------------------------------------- distributions


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _pairs(n: int, what: str) -> list[tuple[int, int]]:
    if n < 2:
        raise FedfmError(f"{what} needs at least two clients, got {n}")
    return list(itertools.combinations(range(n), 2))


def js_divergence(texts: Mapping[str, Sequence[str]]) -> float:
    """Mean pairwise Jensen-Shannon divergence (bits) between clients' unigram distributions.

    Args:
        texts: Client id -> its answers.

    Raises:
        FedfmError: Fewer than two clients, or a client without any word.
    """
    counts = [Counter(w for t in answers for w in _tokens(t)) for answers in texts.values()]
    pairs = _pairs(len(counts), "js_divergence")
    if any(not c for c in counts):
        raise FedfmError("js_divergence: a client's answers hold no word")
    vocab = sorted(set().union(*counts))
    dists = [np.array([c[w] for w in vocab], dtype=np.float64) for c in counts]
    dists = [d / d.sum() for d in dists]
    return float(np.mean([_js(dists[i], dists[j]) for i, j in pairs]))


def _js(p: np.ndarray, q: np.ndarray) -> float:
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return 0.5 * kl(p) + 0.5 * kl(q)


def tfidf_cosine(texts: Mapping[str, Sequence[str]]) -> float:
    """Mean pairwise cosine between clients' TF-IDF centroids (see the module doc).

    Raises:
        FedfmError: Fewer than two clients, or a client without answers.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer

    groups = [list(v) for v in texts.values()]
    pairs = _pairs(len(groups), "tfidf_cosine")
    if any(not g for g in groups):
        raise FedfmError("tfidf_cosine: a client has no answers")
    vec = TfidfVectorizer(token_pattern=r"(?u)\b\w+\b").fit([t for g in groups for t in g])
    cents = [np.asarray(vec.transform(g).mean(axis=0)).ravel() for g in groups]
    return float(np.mean([_cosine(cents[i], cents[j]) for i, j in pairs]))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def update_cosines(updates: Mapping[str, Mapping[str, Tensor]]) -> dict[str, float]:
    """Cosine between each pair of clients' flattened updates (keys in sorted order).

    Returns:
        ``{"<a>|<b>": cosine}`` for every pair and ``mean``.
    """
    cids = sorted(updates)
    flat = {
        c: torch.cat([updates[c][k].flatten().double() for k in sorted(updates[c])]) for c in cids
    }
    out = {
        f"{cids[i]}|{cids[j]}": _cosine(flat[cids[i]].numpy(), flat[cids[j]].numpy())
        for i, j in _pairs(len(cids), "update_cosines")
    }
    out["mean"] = float(np.mean(list(out.values())))
    return out


class UpdateCosines:
    """A round's client updates, collected on the server for their pairwise cosines.

    The server of a FedAvg-style round already receives every client's trained tensors, so
    the update ``Δ_i = θ_i − θ`` is computed there: nothing more leaves a client. Each update
    is kept (flattened, float32) until :meth:`result`: the memory of one adapter per client.

    Args:
        params: The round's global tensors θ, which every reply is compared against.
    """

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        self.params = params
        self.updates: dict[str, dict[str, Tensor]] = {}

    def add(self, cid: str, trained: Mapping[str, Tensor]) -> None:
        """Keeps client ``cid``'s update ``trained − params``."""
        self.updates[cid] = {
            k: (trained[k].detach().float() - v.detach().float()).flatten()
            for k, v in self.params.items()
        }

    def add_delta(self, cid: str, delta: Mapping[str, Tensor]) -> None:
        """Keeps client ``cid``'s update as sent (a client that replies with its Δ)."""
        self.updates[cid] = {k: delta[k].detach().float().flatten() for k in self.params}

    def result(self, prefix: str = "update_cos/") -> dict[str, float]:
        """``<prefix>mean`` and ``<prefix>min`` over client pairs.

        Empty with under two clients (no pair to compare).
        """
        if len(self.updates) < 2:
            return {}
        cos = update_cosines(self.updates)
        pairs = [v for k, v in cos.items() if k != "mean"]
        return {f"{prefix}mean": cos["mean"], f"{prefix}min": float(min(pairs))}


# Headline metrics that are a plain mean over items (each item carries its own value), so that
# the change between two evaluations of the same items is a paired mean.
ITEM_MEANS = ("ref_nll",)


def paired_change(rows: Sequence[Mapping[str, Any]], primary: str) -> dict[str, Any] | None:
    """The change of ``primary`` from the first evaluation in ``rows`` to the last, by item.

    Args:
        rows: ``eval_items.jsonl``'s lines (``round`` and ``items``).
        primary: The headline metric (``zeroshot/`` and ``/<domain>`` allowed).

    Returns:
        ``mean`` and ``se`` of the per-item differences, ``n`` items, ``from_round`` and
        ``to_round``; None where ``primary`` is not a mean over items (:data:`ITEM_MEANS`)
        or fewer than two items were evaluated in both.
    """
    zero = primary.startswith("zeroshot/")
    metric, _, domain = primary.removeprefix("zeroshot/").partition("/")
    if metric not in ITEM_MEANS or len(rows) < 2:
        return None

    def values(row: Mapping[str, Any]) -> dict[tuple[Any, ...], float]:
        return {
            (it["id"], it.get("domain")): float(it[metric])
            for it in row["items"]
            if it.get(metric) is not None
            and bool(it.get("zeroshot")) == zero
            and (not domain or it.get("domain") == domain)
        }

    first, last = values(rows[0]), values(rows[-1])
    diffs = np.array([last[k] - first[k] for k in first if k in last])
    if len(diffs) < 2:
        return None
    return {
        "metric": primary,
        "mean": float(diffs.mean()),
        "se": float(diffs.std(ddof=1) / np.sqrt(len(diffs))),
        "n": len(diffs),
        "from_round": int(rows[0]["round"]),
        "to_round": int(rows[-1]["round"]),
    }
