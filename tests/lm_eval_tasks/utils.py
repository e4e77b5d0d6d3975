"""Helpers of the local lm-eval task ``fedfm_trec20`` (the YAML beside names them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).parent
END_OF_TURN = "<|im_end|>"  # SmolLM2's (and the tiny test tokenizer's) ChatML marker


def load_trec20(**_: Any) -> datasets.DatasetDict:
    """The 20 questions of ``trec20.jsonl`` as the task's test split."""
    return datasets.load_dataset("json", data_files={"test": str(HERE / "trec20.jsonl")})


def choices_then_end_of_turn(doc: dict[str, Any]) -> list[str]:
    """Each label followed by the end-of-turn marker that closes a reply."""
    return [f"{c}{END_OF_TURN}" for c in doc["choices"]]
