"""FedRD's test foundation models: tiny random teachers whose loads are recorded.

``test-tiny-fm`` is a conv layer with BatchNorm (a forward pass in train mode would move its
running statistics) giving 24-d features of 8x8 grey images; ``test-tiny-text-fm`` a 12-d bag
of hashed tokens. Each load appends to ``LOADS`` how many client handlers were open then.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fedfm.algorithms.fedrd import FedRD
from fedfm.config import load_config
from fedfm.core.federation import ClientContext
from fedfm.core.messages import Message
from fedfm.models.encoders import ENCODERS, Encoder, clear_encoders, register_encoder
from fedfm.models.students import HashingTokenizer
from helpers.bases import FEDRD
from helpers.config import make_config

LOADS: list[int] = []  # one entry per foundation-model load: how many client handlers were open
BUILT: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []  # (module, state at load time)
IN_CLIENT = [0]


class TinyFM(nn.Module):
    """Conv + BatchNorm + pooling + Linear: 24-d features of 8x8 grey images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(24, 24)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(nn.functional.adaptive_avg_pool2d(h, 2).flatten(1))


def _record(module: nn.Module) -> None:
    LOADS.append(IN_CLIENT[0])
    BUILT.append((module, {k: v.clone() for k, v in module.state_dict().items()}))


def _tiny_image_fm() -> Encoder:
    torch.manual_seed(123)
    model = TinyFM().eval()
    _record(model)
    return Encoder("test-tiny-fm", 24, model.features, model)


def _tiny_text_fm() -> Encoder:
    torch.manual_seed(321)
    tok = HashingTokenizer(1024)
    bag = nn.EmbeddingBag(1024, 12, mode="mean")
    _record(bag)
    return Encoder("test-tiny-text-fm", 12, lambda texts: bag(*tok.encode(texts)), bag)


if "test-tiny-fm" not in ENCODERS:
    register_encoder("test-tiny-fm", "images")(_tiny_image_fm)
    register_encoder("test-tiny-text-fm", "texts")(_tiny_text_fm)


def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empties the load records, the loaded encoders and their feature caches; counts open
    client handlers."""
    LOADS.clear()
    BUILT.clear()
    clear_encoders()
    orig = FedRD.Client.train  # FedRD's client half is FedAvg's

    def counted(self: Any, ctx: ClientContext, msg: Message) -> Message:
        IN_CLIENT[0] += 1
        try:
            return orig(self, ctx, msg)
        finally:
            IN_CLIENT[0] -= 1

    monkeypatch.setattr(FedRD.Client, "train", counted)


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same keys, and every tensor equal to the bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fedrd_config(out: Any, algorithm: str = "fedrd", **algo: Any) -> Any:
    """The loaded FedRD-family config of ``algorithm`` on digits; ``algo`` changes its section."""
    return load_config(make_config(FEDRD, out, name=algorithm, algorithm=algorithm, algo=algo))
