"""Labelled text with public control codes and a causal LM: the task of DP text generation.

``task.kind: control_text`` is the text-classification task of :mod:`fedfm.tasks.text` (same
sources, splits and partitions; its ``model`` is the downstream classifier, fedfm's small
``text-classifier`` by default) plus:

* **control codes** (:data:`fedfm.tasks.base.CONTROL_CODES`): each row's code is the value of
  ``code_columns`` (default the label, e.g. ``rotten``/``fresh``; several columns form a
  joint code such as ``positive | Depression``). Codes are public metadata (the paper's
  assumption): their list is taken from the whole source, not from any client.
* **a foundation model** (:data:`fedfm.tasks.base.FOUNDATION_MODEL`): the causal LM ``lm``
  (SmolLM2-135M-Instruct by default) behind :class:`fedfm.fm.FoundationModel`, with its own
  LoRA spec and prompt limits.

Choices of ours: rows whose code is not among the ``max_codes`` most frequent codes of the
source are dropped before splitting (none dropped when ``max_codes`` is unset); codes are
ordered as the label's class names for ``code_columns: [label]`` and sorted otherwise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedfm.data import synthetic  # noqa: F401  (registers the ``synthetic`` text source)
from fedfm.data.prompt import PromptConfig
from fedfm.data.sources import LoadedSource, load_source
from fedfm.errors import ConfigError
from fedfm.fm import FoundationModel
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import CONTROL_CODES, FOUNDATION_MODEL, TASKS, TaskConfig
from fedfm.tasks.text import TextConfig, TextData, TextTask

CODE_SEP = " | "


class ControlTextConfig(TextConfig):
    """Config of ``task.kind: control_text`` (every field of ``text`` plus the LM and codes).

    Attributes:
        code_columns: Source columns whose values form a row's control code (``label`` is
            the class label by name).
        max_codes: Keep only rows of the most frequent codes (``None``: all codes).
        lm: The causal LM that generates (a model-registry name).
        lm_args: Arguments of its builder (``tiny-llama`` sizes in tests).
        lm_dtype: Dtype of its frozen weights.
        autocast_bf16: Run its forward passes under bfloat16 autocast.
        lora: LoRA spec of its adapters.
        prompt: Prompt formatting and length limits of the LM.
    """

    kind: Literal["control_text"] = "control_text"  # type: ignore[assignment]
    code_columns: list[str] = Field(default_factory=lambda: ["label"], min_length=1)
    max_codes: int | None = Field(None, ge=1)
    lm: str = "smollm2-135m-instruct"
    lm_args: dict[str, Any] = Field(default_factory=dict)
    lm_dtype: Literal["float32", "bfloat16"] = "float32"
    autocast_bf16: bool = False
    lora: LoraConfigSpec = Field(default_factory=LoraConfigSpec)
    prompt: PromptConfig = Field(
        default_factory=lambda: PromptConfig(max_length=128, max_prompt_length=64)
    )


class ControlTextTask(TextTask):
    """Text classification whose rows carry public control codes, with a causal LM."""

    Config = ControlTextConfig

    def __init__(self, cfg: ControlTextConfig, run: Any) -> None:
        self.cfg: ControlTextConfig = cfg
        src = load_source(cfg.dataset, **cfg.source_options)
        self._code_names, self._code_of = _codes(src, cfg)
        super().__init__(cfg, run)
        self._fm: FoundationModel | None = None

    def _split(self, src: LoadedSource) -> tuple[Any, Any]:
        train, test = super()._split(src)
        return self._known(train), self._known(test)

    def _known(self, ds: Any) -> Any:
        """Rows whose code is kept (all unless ``max_codes``)."""
        if self.cfg.max_codes is None:
            return ds
        keep = [i for i, sid in enumerate(ds["id"]) if int(sid) in self._code_of]
        return ds.select(keep)

    # ----- capabilities -----
    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """The parent's capabilities plus control codes and the foundation model."""
        return super().provides(cfg) | {CONTROL_CODES, FOUNDATION_MODEL}

    def codes(self) -> list[str]:
        """The public control codes (from ``code_columns``) in a fixed order."""
        return list(self._code_names)

    def code_ids(self, data: TextData) -> Tensor:
        """Each row's code as an index into :meth:`codes` (``[N]``)."""
        return torch.as_tensor([self._code_of[int(i)] for i in data.ids], dtype=torch.long)

    def code_labels(self) -> list[int | None]:
        """The class label of each code (``None`` when ``label`` is not a code column)."""
        if "label" not in self.cfg.code_columns:
            return [None] * len(self._code_names)
        pos = self.cfg.code_columns.index("label")
        names = list(self.src.class_names or [])
        return [names.index(code.split(CODE_SEP)[pos]) for code in self._code_names]

    def heldout(self) -> dict[str, Any]:
        """The source, its options, class names and the test rows' sample ids."""
        return {
            "dataset": self.cfg.dataset,
            "source_options": dict(self.cfg.source_options),
            "class_names": list(self.src.class_names or []),
            "ids": [int(i) for i in self.test_data().ids],
        }

    def labelled(self, texts: Sequence[str], labels: Sequence[int]) -> TextData:
        """Texts with labels as task data (ids ``0..n-1``), ready for the task's classifier."""
        from datasets import Dataset

        ds = Dataset.from_dict(
            {"id": list(range(len(texts))), "text": list(texts), "label": list(labels)}
        )
        return self.to_data(ds)

    def foundation_model(self) -> FoundationModel:
        """The handle on the task's causal LM (loaded on first use)."""
        if self._fm is None:
            self._fm = FoundationModel(
                self.cfg.lm,
                self.cfg.lm_dtype,
                self.cfg.lm_args,
                lora=self.cfg.lora,
                prompt=self.cfg.prompt,
                autocast_bf16=self.cfg.autocast_bf16,
                device=self.device,
            )
        return self._fm

    def stats(self) -> dict[str, Any]:
        """The parent's statistics plus the codes and each client's code counts."""
        counts = {
            c: np.bincount(self.code_ids(self.client_data(c)), minlength=len(self._code_names))
            for c in self.client_ids()
        }
        return {
            **super().stats(),
            "codes": self.codes(),
            "code_counts": {c: v.tolist() for c, v in counts.items()},
        }


def _codes(src: LoadedSource, cfg: ControlTextConfig) -> tuple[list[str], dict[int, int]]:
    """The code names and each source row's code index (by sample id).

    Raises:
        ConfigError: A code column is not a column of the source (``task.code_columns``).
    """
    splits = [s for s in (src.train, src.test) if s is not None]
    have = set(src.train.column_names) - {"id", "text"}
    for col in cfg.code_columns:
        if col not in have:
            raise ConfigError(
                "task.code_columns",
                f"'{col}' is not a column of '{cfg.dataset}' (columns: {', '.join(sorted(have))})",
            )
    names = list(src.class_names or [])
    ids: list[int] = []
    values: list[str] = []
    for split in splits:
        cols = [
            [names[int(v)] for v in split[c]] if c == "label" else [str(v) for v in split[c]]
            for c in cfg.code_columns
        ]
        ids += [int(i) for i in split["id"]]
        values += [CODE_SEP.join(parts) for parts in zip(*cols, strict=True)]
    counts = Counter(values)
    kept = {c for c, _ in counts.most_common(cfg.max_codes)}
    # Label codes keep the class order; other codes have no natural order.
    order = [n for n in names if n in kept] if cfg.code_columns == ["label"] else sorted(kept)
    index = {c: j for j, c in enumerate(order)}
    return order, {i: index[v] for i, v in zip(ids, values, strict=True) if v in index}


TASKS.register(
    "control_text", "labelled text with public control codes and a causal LM (DP synthesis)"
)(ControlTextTask)
