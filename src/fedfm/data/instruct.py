"""A multi-domain instruction suite built from the offline sources.

Federated instruction tuning papers train on Dolly-15k or Natural-Instructions split by task or
category (e.g. FedIT, Zhang et al. 2024; FedSDR's multi-domain clients). Neither ships offline, so
this suite stands in at CPU scale: six domains, each made from a real data set, each with its own
evaluation metric:

========  ======================  ========  ===============================================
domain    source                  metric    item
========  ======================  ========  ===============================================
general   alpaca_demo             rouge     Alpaca instruction / input / output as given
math      gsm8k                   gsm8k     problem -> worked solution ending ``#### N``
medical   drug_reviews            choice    drug review (+ condition) -> negative/neutral/positive
movie     rotten_tomatoes         choice    critic snippet -> negative/positive
qtype     trec                    choice    question -> one of six answer types
spam      sms_spam                choice    SMS -> ham/spam
========  ======================  ========  ===============================================

Three more domains split ``alpaca_demo`` by the kind of instruction (ours: the instruction's
first word, as the Alpaca paper reads its instructions by their leading verb), open-ended
categories in the manner of Dolly-15k's: ``alpaca_creative`` (generate, create, write, design,
suggest ...: 323 rows), ``alpaca_qa`` (describe, what, explain, how, compare, list, name ...:
295) and ``alpaca_task`` (every other row, mostly work on a given input: rewrite, summarize,
identify, classify ...: 381). They partition ``general``'s rows, so ``general`` is not
combined with them.

For ``choice`` domains the instruction names the allowed answers and ``output`` is exactly the
label word (also in ``answer``; ``choices`` lists the label words in label order). The wording of
each instruction is drawn from a few paraphrases so that clients do not all see one template.

Sampling is per domain with its own generator ``default_rng([seed, domain index])``, so choosing a
subset of domains leaves the others' items unchanged. Held-out items come from the source's own
test split when it has one (drug reviews), else from rows disjoint from the training items. Ids
are ``domain index * 1,000,000 + source id``: stable across seeds and unique across domains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pandas as pd

from fedfm.data.arrow import build_dataset
from fedfm.data.sources import (
    LoadedSource,
    SourceInfo,
    load_source,
    register_source,
    source_info,
)
from fedfm.errors import ConfigError

FIELD = "task.source_options"
ID_STRIDE = 1_000_000

SUITE_FEATURES = datasets.Features(
    {
        "id": datasets.Value("int64"),
        "instruction": datasets.Value("string"),
        "input": datasets.Value("string"),
        "output": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "metric": datasets.Value("string"),
        "choices": datasets.List(datasets.Value("string")),
        "answer": datasets.Value("string"),
    }
)

# Columns each builder returns for its sampled rows (the rest are filled in by the suite).
Items = dict[str, list[str]]


@dataclass(frozen=True)
class Domain:
    """How one domain is made.

    Attributes:
        source: Registered source it is built from.
        metric: ``rouge``, ``gsm8k`` or ``choice``.
        choices: Label words in label order (choice domains), else empty.
        templates: Instruction paraphrases; one is drawn per item. ``{choices}`` in a template
            lists the label words in an order drawn per item (see :func:`listed_choices`).
        make: Turns the sampled source rows into ``instruction``-less items
            (``input``, ``output``, ``answer``) given the choices.
        keep: The source rows this domain draws from (a boolean mask); None: all of them.
    """

    source: str
    metric: str
    choices: tuple[str, ...]
    templates: tuple[str, ...]
    make: Callable[[pd.DataFrame, tuple[str, ...]], Items]
    keep: Callable[[pd.DataFrame], np.ndarray] | None = None


def _general(rows: pd.DataFrame, _: tuple[str, ...]) -> Items:
    return {
        "instruction": rows["instruction"].tolist(),
        "input": rows["input"].tolist(),
        "output": rows["output"].tolist(),
        "answer": [""] * len(rows),
    }


# Alpaca's instructions by their first word (ours): what a Dolly-like category would hold.
ALPACA_CATEGORIES: dict[str, frozenset[str]] = {
    "creative": frozenset((
        "generate", "create", "write", "design", "compose", "construct", "imagine", "come",
        "make", "develop", "brainstorm", "suggest", "formulate", "invent", "produce", "draft",
        "think", "propose", "plan", "devise", "build", "tell",
    )),
    "qa": frozenset((
        "describe", "what", "explain", "how", "why", "who", "when", "where", "which", "compare",
        "name", "list", "give", "provide", "define", "outline", "discuss", "is", "are", "do",
        "does", "can", "state", "research", "evaluate", "predict", "estimate",
    )),
}  # fmt: skip
TASK = "task"  # every other instruction


def alpaca_category(instruction: str) -> str:
    """An Alpaca instruction's category: ``creative``, ``qa`` or ``task`` (the rest)."""
    words = instruction.split()
    first = words[0].lower().strip(",.:?!") if words else ""
    return next((c for c, verbs in ALPACA_CATEGORIES.items() if first in verbs), TASK)


def _in_category(category: str) -> Callable[[pd.DataFrame], np.ndarray]:
    def keep(rows: pd.DataFrame) -> np.ndarray:
        return np.asarray([alpaca_category(str(i)) == category for i in rows["instruction"]])

    return keep


def _alpaca(category: str) -> Domain:
    return Domain("alpaca_demo", "rouge", (), (), _general, _in_category(category))


def _math(rows: pd.DataFrame, _: tuple[str, ...]) -> Items:
    return {
        "input": rows["instruction"].tolist(),  # the gsm8k source keeps the problem there
        "output": rows["output"].tolist(),
        "answer": rows["answer"].tolist(),
    }


def _labelled(text: Callable[[pd.Series], str]) -> Callable[[pd.DataFrame, tuple[str, ...]], Items]:
    def make(rows: pd.DataFrame, choices: tuple[str, ...]) -> Items:
        words = [choices[int(i)] for i in rows["label"]]
        return {"input": [text(r) for _, r in rows.iterrows()], "output": words, "answer": words}

    return make


def _review_with_condition(row: pd.Series) -> str:
    if row["condition"] in ("", "unknown"):
        return f"Review: {row['text']}"
    return f"Condition: {row['condition']}\nReview: {row['text']}"


DOMAINS: dict[str, Domain] = {
    "general": Domain("alpaca_demo", "rouge", (), (), _general),
    "math": Domain(
        "gsm8k",
        "gsm8k",
        (),
        (
            "Solve this math word problem. Show your reasoning, then give the final answer "
            "after '####'.",
            "Work out the answer to the following problem step by step and finish with "
            "'#### ' followed by the number.",
            "Answer the math question below. Explain each step and end with '#### <answer>'.",
        ),
        _math,
    ),
    "medical": Domain(
        "drug_reviews",
        "choice",
        ("negative", "neutral", "positive"),
        (
            "Classify the sentiment of this drug review as {choices}.",
            "Read the patient's review of a medication. Was their experience {choices}? Answer "
            "with one word.",
            "How does this patient feel about the drug they took? Reply with {choices}.",
        ),
        _labelled(_review_with_condition),
    ),
    "movie": Domain(
        "rotten_tomatoes",
        "choice",
        ("negative", "positive"),  # label 0 = rotten, 1 = fresh
        (
            "Is the sentiment of this movie review {choices}?",
            "Classify this film critic's snippet as {choices}.",
            "Did the critic like the movie? Answer {choices}.",
        ),
        _labelled(lambda r: str(r["text"])),
    ),
    "qtype": Domain(
        "trec",
        "choice",
        ("abbreviation", "description", "entity", "human", "location", "number"),
        (
            "What kind of answer does this question ask for? Choose one of: {choices}.",
            "Classify the question by the type of its answer: {choices}.",
            "Which answer type fits this question: {choices}? Reply with one word.",
        ),
        _labelled(lambda r: str(r["text"])),
    ),
    "spam": Domain(
        "sms_spam",
        "choice",
        ("ham", "spam"),
        (
            "Is this SMS message spam or ham (a normal message)? Answer {choices}.",
            "Decide whether the following text message is spam or ham (legitimate). Reply with "
            "one word: {choices}.",
            "Label this SMS as {choices}.",
        ),
        _labelled(lambda r: str(r["text"])),
    ),
}
"""The suite's six domains (its default)."""
CATEGORIES: dict[str, Domain] = {f"alpaca_{c}": _alpaca(c) for c in (*ALPACA_CATEGORIES, TASK)}
"""Alpaca's rows by category, chosen by name (``domains``) instead of ``general``."""
# The categories come after the six, so that their indices (ids, generators) stay as they were.
ALL_DOMAINS = {**DOMAINS, **CATEGORIES}
DOMAIN_ORDER = tuple(ALL_DOMAINS)
ALPACA_DOMAINS = tuple(CATEGORIES)


def _frame(ds: datasets.Dataset) -> pd.DataFrame:
    return ds.to_pandas()


def _sample(
    src: LoadedSource,
    n_train: int,
    n_test: int,
    rng: np.random.Generator,
    name: str,
    balanced: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Draws disjoint train and test rows (test from the source's own test split if any).

    ``balanced``: a labelled domain's test rows hold each label equally often.
    """
    train_pool = _frame(src.train)
    keep = ALL_DOMAINS[name].keep
    if keep is not None:
        train_pool = train_pool[keep(train_pool)].reset_index(drop=True)
    even = balanced and bool(ALL_DOMAINS[name].choices)
    if src.test is not None:
        test_pool = _frame(src.test)
        _check_size(name, "per_domain_test", n_test, len(test_pool))
        _check_size(name, "per_domain_train", n_train, len(train_pool))
        order = rng.permutation(len(test_pool))
        picks = _even(test_pool, order, n_test, name) if even else order[:n_test]
        test = test_pool.iloc[np.sort(picks)]
        train = train_pool.iloc[np.sort(rng.permutation(len(train_pool))[:n_train])]
        return train, test
    _check_size(name, "per_domain_train", n_train + n_test, len(train_pool))
    perm = rng.permutation(len(train_pool))
    picks = _even(train_pool, perm, n_test, name) if even else perm[:n_test]
    rest = perm[~np.isin(perm, picks)]
    _check_size(name, "per_domain_train", n_train, len(rest))
    test = train_pool.iloc[np.sort(picks)]
    train = train_pool.iloc[np.sort(rest[:n_train])]
    return train, test


def _even(pool: pd.DataFrame, order: np.ndarray, n: int, name: str) -> np.ndarray:
    """Draws ``n`` rows with each label equally often.

    ``n`` row positions of ``pool`` in the drawn ``order``, an equal number per label (the
    remainder to the lowest labels): a majority answer then scores chance in accuracy too.
    """
    labels = pool["label"].to_numpy()[order]
    classes = sorted(set(labels.tolist()))
    per, extra = divmod(n, len(classes))
    picks = []
    for i, c in enumerate(classes):
        want = per + (i < extra)
        got = order[labels == c][:want]
        _check_size(f"{name}, label {c}", "per_domain_test", want, int(np.sum(labels == c)))
        picks.append(got)
    return np.concatenate(picks)


def _check_size(domain: str, field: str, wanted: int, available: int) -> None:
    if wanted > available:
        raise ConfigError(
            f"{FIELD}.{field}",
            f"domain '{domain}' has {available} rows, {wanted} requested",
        )


def listed_choices(domain: str, source_id: int) -> str:
    """A domain's label words as an instruction lists them for one item: ``"a, b or c"``.

    The order is drawn per item (seeded by domain and source row, so it does not depend on
    which rows were sampled): listed always in one order, a small base model scored by summed
    log-likelihood answered the first-listed TREC type (``abbreviation``, about 1.6% of TREC)
    for 56 of 60 questions; in a drawn order its answers spread over the types
    (docs/evaluation.md).
    """
    words = ALL_DOMAINS[domain].choices
    order = np.random.default_rng([DOMAIN_ORDER.index(domain), source_id]).permutation(len(words))
    listed = [words[i] for i in order]
    return ", ".join(listed[:-1]) + " or " + listed[-1] if len(listed) > 1 else "".join(listed)


def _items(name: str, rows: pd.DataFrame, rng: np.random.Generator) -> dict[str, list]:
    dom = ALL_DOMAINS[name]
    items = dom.make(rows, dom.choices)
    n = len(rows)
    source_ids = rows["id"].to_numpy(dtype=np.int64)
    if "instruction" not in items:
        picks = rng.integers(0, len(dom.templates), size=n)
        items["instruction"] = [
            dom.templates[i].format(choices=listed_choices(name, int(sid)))
            for i, sid in zip(picks, source_ids, strict=True)
        ]
    if n and int(source_ids.max()) >= ID_STRIDE:
        raise ValueError(f"{dom.source} ids exceed {ID_STRIDE}; widen ID_STRIDE")
    return {
        "id": (DOMAIN_ORDER.index(name) * ID_STRIDE + source_ids).tolist(),
        "instruction": items["instruction"],
        "input": items["input"],
        "output": items["output"],
        "domain": [name] * n,
        "metric": [dom.metric] * n,
        "choices": [list(dom.choices)] * n,
        "answer": items["answer"],
    }


def _concat(parts: Sequence[dict[str, list]]) -> datasets.Dataset:
    cols: dict[str, Any] = {k: [v for p in parts for v in p[k]] for k in SUITE_FEATURES}
    cols["id"] = np.asarray(cols["id"], dtype=np.int64)
    return build_dataset(cols, SUITE_FEATURES)


def _test_counts(per_domain_test: int | Mapping[str, int], chosen: list[str]) -> dict[str, int]:
    """Each chosen domain's test count (one count for all, or a mapping naming each domain)."""
    field = f"{FIELD}.per_domain_test"
    if isinstance(per_domain_test, Mapping):
        named = set(per_domain_test)
        if named != set(chosen):
            raise ConfigError(field, f"must name exactly the domains {chosen}, got {sorted(named)}")
        counts = {str(k): v for k, v in per_domain_test.items()}
    else:
        counts = dict.fromkeys(chosen, per_domain_test)
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(field, f"{name}: must be an integer >= 0, got {n!r}")
    return counts


def build_suite(
    per_domain_train: int = 200,
    per_domain_test: int | Mapping[str, int] = 40,
    seed: int = 0,
    domains: Sequence[str] | None = None,
    balanced_test: bool = False,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Builds the suite's train and held-out test sets.

    Builds the suite's train and held-out test sets (test is ``None`` when ``per_domain_test``
    is 0 for every domain); ``per_domain_test`` is one count for every domain or a count per
    chosen domain (e.g. 40 seen items of a trained domain beside 200 of a zero-shot one, whose
    labels a balanced draw of 200 would exhaust in the other); ``balanced_test``: each
    labelled domain's test rows hold its labels equally often.

    Raises:
        ConfigError: Unknown domain, negative size, or more items than a domain's source holds.
    """
    chosen = list(DOMAINS if domains is None else domains)
    unknown = [d for d in chosen if d not in ALL_DOMAINS]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        raise ConfigError(
            f"{FIELD}.domains",
            f"{chosen} must be distinct names among {', '.join(DOMAIN_ORDER)}",
        )
    if "general" in chosen and set(chosen) & set(ALPACA_DOMAINS):
        raise ConfigError(
            f"{FIELD}.domains",
            f"general and {', '.join(ALPACA_DOMAINS)} draw from the same Alpaca rows: choose"
            " general or its categories",
        )
    if per_domain_train < 1:
        raise ConfigError(f"{FIELD}.per_domain_train", f"must be >= 1, got {per_domain_train}")
    n_test = _test_counts(per_domain_test, chosen)
    train_parts, test_parts = [], []
    for name in sorted(chosen, key=DOMAIN_ORDER.index):
        rng = np.random.default_rng([seed, DOMAIN_ORDER.index(name)])
        src = load_source(ALL_DOMAINS[name].source)
        train_rows, test_rows = _sample(
            src, per_domain_train, n_test[name], rng, name, balanced_test
        )
        train_parts.append(_items(name, train_rows, rng))
        test_parts.append(_items(name, test_rows, rng))
    test = _concat(test_parts) if any(n_test.values()) else None
    return _concat(train_parts), test


@register_source(
    SourceInfo(
        "instruct_suite",
        "instruction",
        "built from alpaca_demo, gsm8k, drug_reviews, rotten_tomatoes, trec, sms_spam",
        "the licences of those sources (alpaca content CC BY-NC 4.0)",
        "Multi-domain instructions (general, math, medical, movie, qtype, spam), 200 train + "
        "40 test per domain by default; CPU-scale stand-in for Dolly-15k / Natural-Instructions",
    )
)
def instruct_suite(
    per_domain_train: int = 200,
    per_domain_test: int | Mapping[str, int] = 40,
    seed: int = 0,
    domains: list[str] | None = None,
    balanced_test: bool = False,
) -> LoadedSource:
    """The multi-domain instruction suite as a source (see the module docstring)."""
    train, test = build_suite(per_domain_train, per_domain_test, seed, domains, balanced_test)
    return LoadedSource(source_info("instruct_suite"), train, test)
