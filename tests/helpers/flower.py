"""Test support for the Flower runtime, importable by ClientApp processes (``imports``).

Registers the toy task, ``test-crashy`` (clients that fail in each way a reply can) and
``test-two-phase``, a multi-exchange algorithm that uses every
pattern of the federation interface: a phase before round 1, two exchanges per round with
server-side training between them, client roles, persistent client state, randomness drawn
from the seeded torch RNG inside handlers, and a phase after the last round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import helpers.toy  # noqa: F401  (registers the toy task)
from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message, MessageKind
from helpers.bases import DPSYN, FEDRD, FEDSDR, fedsdr_algo
from helpers.config import make_config, toy_config


class TwoPhaseClient(ClientHalf):
    """TwoPhase's client half."""

    def handlers(self):
        return {
            "profile": lambda ctx, m: Message(
                "profile", meta={"n": self.task.num_examples(ctx.data)}
            ),
            "stats": self._stats,
            "step": self._step,
            "vote": lambda ctx, m: Message("vote", meta={"vote": float(ctx.data[1].mean())}),
            "final": lambda ctx, m: Message(
                "final", meta={"count": ctx.state.meta.get("count", 0)}
            ),
        }

    def _stats(self, ctx: ClientContext, msg: Message) -> Message:
        ctx.state.meta["count"] = ctx.state.meta.get("count", 0) + 1
        ctx.state.set_group("seen", {"w": msg.arrays["w"]["w"]})
        info = {"rnd": float(ctx.rnd), "norm": float(msg.arrays["w"]["w"].norm())}
        return Message(
            "stats",
            {"mean": {"x": ctx.data[0].mean(0)}},
            {"count": ctx.state.meta["count"], "info": info},
        )

    def _step(self, ctx: ClientContext, msg: Message) -> Message:
        x, y = ctx.data
        w = msg.arrays["w"]["w"].clone().requires_grad_(True)
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        # Noise from the global torch RNG: equal on every runtime only if seeding is.
        new = w.detach() - 0.05 * w.grad + 0.01 * torch.randn(w.shape)
        ctx.state.set_group("own", {"w": new})
        return Message("step", {"w": {"w": new}})


class TwoPhase(Algorithm):
    """Round: every sampled client reports its feature mean (and bumps a private counter);
    the server fits ``w`` to the means by SGD; then "strong" clients take a noisy step on
    their own data and "weak" clients vote. The server evaluates ``w`` on the test set."""

    Client = TwoPhaseClient
    messages = (
        MessageKind("profile", up_meta=("n",)),
        MessageKind("stats", down_arrays=("w",), up_arrays=("mean",), up_meta=("count", "info")),
        MessageKind("step", down_arrays=("w",), up_arrays=("w",), roles=("strong",)),
        MessageKind("vote", down_arrays=("w",), up_meta=("vote",), roles=("weak",)),
        MessageKind("final", up_meta=("count",)),
    )

    def __init__(self, cfg: Any, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.w = torch.zeros(task.cfg.dim)
        self.profile: dict[str, int] = {}

    def setup(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("profile"), fed.client_ids())
        self.profile = {c: r.meta["n"] for c, r in replies.items()}
        return {"profiled": len(replies)}

    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        r1 = fed.broadcast(
            Message("stats", {"w": {"w": self.w}}), cids, like={"mean": {"x": self.w}}
        )
        self.require(fed, r1, len(cids))
        means = torch.stack([r.arrays["mean"]["x"] for r in r1.values()])
        w = self.w.clone().requires_grad_(True)
        opt = torch.optim.SGD([w], lr=0.3)
        for _ in range(5):
            opt.zero_grad()
            ((w - means.mean(0)) ** 2).sum().backward()
            opt.step()
        self.w = w.detach()
        strong = [c for c in cids if fed.role_of(c) == "strong"]
        weak = [c for c in cids if fed.role_of(c) == "weak"]
        r2 = fed.broadcast(Message("step", {"w": {"w": self.w}}), strong, like={"w": {"w": self.w}})
        if r2:
            self.w = torch.stack([r.arrays["w"]["w"] for r in r2.values()]).mean(0)
        r3 = fed.broadcast(Message("vote", {"w": {"w": self.w}}), weak)
        votes = [r.meta["vote"] for r in r3.values()]
        return {
            "stats": len(r1),
            "stepped": len(r2),
            "votes": len(r3),
            "vote_mean": sum(votes) / len(votes) if votes else 0.0,
            "w0": float(self.w[0]),
        }

    def evaluate(self, fed: Federation) -> dict[str, float]:
        x, y = self.task.test_data()
        mse = float(((x @ self.w - y) ** 2).mean())
        return {"rmse": mse**0.5, "loss": mse}

    def finish(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("final"), fed.client_ids())
        return {c: r.meta["count"] for c, r in replies.items()}

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return {"w": self.w}, {"profile": self.profile}

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.w = arrays["w"]
        self.profile = meta["profile"]


if "test-two-phase" not in ALGORITHMS:
    ALGORITHMS.register("test-two-phase", "multi-exchange test algorithm")(TwoPhase)


class CrashyClient(ClientHalf):
    """Client 1 raises, 2 sends NaN, 3 a wrong shape, 4 an extra key; the others answer."""

    def handlers(self):
        def train(ctx: ClientContext, msg: Message) -> Message:
            ctx.state.meta["touched"] = True
            if ctx.cid == "1":
                raise RuntimeError("disk full")
            if ctx.cid == "2":
                return Message("train", {"p": {"w": torch.tensor([float("nan"), 0.0])}})
            if ctx.cid == "3":
                return Message("train", {"p": {"w": torch.zeros(3)}})
            if ctx.cid == "4":
                return Message("train", {"p": {"w": torch.zeros(2), "bias": torch.zeros(1)}})
            return Message("train", {"p": {"w": torch.ones(2)}})

        return {"train": train}


class Crashy(Algorithm):
    """Client 1 raises, 2 sends NaN, 3 a wrong shape, 4 an extra key; the others answer."""

    Client = CrashyClient
    messages = (MessageKind("train", down_arrays=("p",), up_arrays=("p",)),)
    Config = AlgoConfig

    def __init__(self, cfg: Any, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.p = {"w": torch.zeros(2)}

    def round(self, fed: Federation) -> dict[str, float]:
        cids = fed.client_ids()
        replies = fed.broadcast(Message("train", {"p": self.p}), cids, like={"p": self.p})
        self.require(fed, replies, len(cids))
        return {"ok": len(replies)}


if "test-crashy" not in ALGORITHMS:
    ALGORITHMS.register("test-crashy")(Crashy)


# --------------------------------------------------------------------------- every algorithm


def _tiny_fm() -> Any:
    """A tiny frozen image foundation model for FedRD on 8x8 digits (24-d features)."""
    from torch import nn

    from fedfm.models.encoders import Encoder

    torch.manual_seed(123)
    body = nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
    ).eval()
    return Encoder("flower-test-fm", 24, body, body)


def _register_teacher() -> None:
    try:
        from fedfm.models.encoders import ENCODERS, register_encoder
    except ImportError:  # no encoder registry in this tree
        return
    if "flower-test-fm" not in ENCODERS:
        register_encoder("flower-test-fm", "images", "tiny test foundation model")(_tiny_fm)


_register_teacher()

# Modules every process imports for the algorithm configs below (they register themselves).
ALGORITHM_MODULES = ["fedfm.algorithms.fedekd", "fedfm.algorithms.fedrd"]


def import_algorithms() -> None:
    """Imports the algorithm modules (each registers its algorithms)."""
    import importlib

    for name in ALGORITHM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def algorithm_config(out: Path, algorithm: str) -> dict[str, Any] | None:
    """A small config for each registered algorithm (None: no config known here)."""
    if algorithm in ("fedavg", "fedprox", "scaffold", "local", "test-two-phase"):
        return toy_config(out, algorithm, rounds=2)
    if algorithm in ("fedekd", "fedkd-ungated", "local-private"):
        import yaml

        from fedfm.config import preset_dir

        cfg = yaml.safe_load((preset_dir() / "fedekd-breast-cancer.yaml").read_text())
        cfg.update(
            name=algorithm, algorithm=algorithm, rounds=2, eval_every=1, out_dir=str(out),
            plots=False,
        )  # fmt: skip
        cfg["partition"] = {**cfg["partition"], "num_clients": 4}
        cfg["clients"] = {"fraction": 0.75, "min_clients": 2}
        cfg["train"] = {**cfg["train"], "steps": 2}
        if algorithm == "fedkd-ungated":
            cfg["algo"] = {**cfg["algo"], "gate": "ungated"}
        return cfg
    if algorithm in ("fedrd", "fedrd-kd", "fedrd-nophi", "fed-hint", "fedavg-ft"):
        # FedRD's test setting on three clients, with this module's teacher (Flower processes
        # import this module, not helpers.fedrd).
        return make_config(
            FEDRD,
            out,
            name=algorithm,
            algorithm=algorithm,
            algo={"teacher": "flower-test-fm"},
            task__max_train=600,
            partition__num_clients=3,
            clients={"min_clients": 2},
        )
    if algorithm == "dpsyn":
        return _dpsyn_config(out)
    if algorithm == "fedsdr":
        return _fedsdr_config(out)
    return None


# Checked on Flower by their own tests instead (a reason per algorithm).
COVERED_ELSEWHERE = {
    "fedhds": "tests/unit/algorithms/test_fedhds.py::"
    "test_flower_runtime_selects_and_trains_as_embedded:"
    " its replies carry timings, whose digits change the meta bytes between any two runs",
}


def _dpsyn_config(out: Path) -> dict[str, Any]:
    """The dpsyn tests' own tiny setup (profile, one DP-SGD round, generation, voting)."""
    cfg = make_config(DPSYN, out, threads=1)
    cfg["algo"]["eval"] = {"clf_steps": 5}  # no base-model floor: half the generation
    return cfg


def _fedsdr_config(out: Path) -> dict[str, Any]:
    """The FedSDR tests' own tiny setup: round-0 rewrites, then two dual-stream rounds."""
    algo = fedsdr_algo(out / "rewrites")
    algo["fedsd"]["cache"] = False  # both runs rewrite (a cache hit is counted in metrics)
    cfg = make_config(FEDSDR, out, name="fedsdr", algorithm="fedsdr", algo=algo)
    cfg = load_config(cfg).model_dump(mode="json")
    # One client per domain (a natural partition of three domains).
    cfg["partition"] = {**cfg["partition"], "num_clients": 3}
    return {**cfg, "task": {**cfg["task"], "max_eval": 3}}
