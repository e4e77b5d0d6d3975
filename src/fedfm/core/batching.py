"""Right-padded token batches: the one batch format of causal-LM training, DP-SGD and scoring.

Rows are dicts of ``input_ids`` and ``labels`` (``attention_mask`` optional), as
:func:`fedfm.data.prompt.encode_example` writes them; labels are :data:`IGNORE_INDEX` where no
loss falls (prompt tokens, padding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedfm.errors import FedfmError

IGNORE_INDEX = -100
"""Label value ignored by ``torch.nn.functional.cross_entropy`` (its default ``ignore_index``)."""


def collate(
    batch: Sequence[Mapping[str, Sequence[int]]], pad_id: int, multiple: int = 1
) -> dict[str, Tensor]:
    """Right-pads encoded rows into tensors for training.

    Args:
        batch: Rows with ``input_ids`` and ``labels`` (``attention_mask`` optional).
        pad_id: Token id used for padding ``input_ids``.
        multiple: Pad the length up to a multiple of this (fewer distinct tensor shapes).

    Returns:
        ``input_ids``, ``attention_mask`` (0 on padding) and ``labels`` (``-100`` on padding), each
        a ``long`` tensor of shape ``(batch, longest)``, longest rounded up to ``multiple``.
    """
    if not batch:
        raise FedfmError("collate received an empty batch")
    width = max(len(row["input_ids"]) for row in batch)
    width = -(-width // multiple) * multiple
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(batch):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention[i, :n] = torch.as_tensor(row.get("attention_mask", [1] * n), dtype=torch.long)
        labels[i, :n] = torch.as_tensor(row.get("labels", row["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
