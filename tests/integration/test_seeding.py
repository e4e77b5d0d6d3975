"""Seeding contracts: where randomness comes from, and that it differs where it must.

Every random draw in a run is derived from (run seed, round, client, purpose)
(:func:`fedfm.core.federation.derive_seed`). These tests pin the contract from outside:
different run seeds sample different clients, different clients and rounds get different
streams, and the same (seed, round, client, purpose) gives the same stream on the embedded
runtime and on the Flower runtime (driven through the in-memory grid of ``helpers.grid``).
Resume tests compare the code with itself and cannot see a stream that ignores the round
or the client; these can.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import helpers.seed_probe  # noqa: F401  (registers test-seed-probe)
from fedfm.config import TrainConfig, load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import (
    ClientContext,
    ClientInfo,
    ClientRunner,
    ClientState,
    derive_seed,
)
from fedfm.core.messages import Message, MessageKind
from fedfm.core.train import local_round
from fedfm.runtime import run
from helpers import toy
from helpers.config import toy_config
from helpers.grid import flower_run

# The in-memory Flower grid runs in this process: it needs a task identity (conftest.py).
pytestmark = pytest.mark.usefixtures("task_identity")

CIDS = [str(i) for i in range(20)]


def _sample(seed: int, rnd: int, fraction: float = 0.25, **kw: Any) -> tuple[str, ...]:
    fed = FakeFederation(CIDS, {}, seed=seed)
    fed.rnd = rnd
    return tuple(fed.sample(fraction, **kw))


# ----------------------------------------------------------------------------- client sampling


def test_client_samples_depend_on_the_run_seed() -> None:
    by_seed = [_sample(seed, rnd=1) for seed in range(6)]
    assert all(len(s) == 5 for s in by_seed)
    # C(20, 5) = 15504 possible samples: six seeds drawing fewer than five distinct ones
    # would mean the seed is (nearly) ignored.
    assert len(set(by_seed)) >= 5, by_seed
    for rnd in (1, 2, 3):  # and in every round, not only the first
        assert len({_sample(seed, rnd) for seed in range(4)}) >= 3


def test_client_samples_depend_on_the_round_and_repeat_exactly() -> None:
    by_round = [_sample(0, rnd) for rnd in range(1, 7)]
    assert len(set(by_round)) >= 5, by_round
    assert [_sample(0, rnd) for rnd in range(1, 7)] == by_round  # same seed and round: same
    # Roles sample separately: the 'weak' pool's sample is drawn from the weak clients only.
    infos = [ClientInfo(c, "weak" if int(c) % 2 else "default") for c in CIDS]
    fed = FakeFederation(infos, {}, seed=0)
    fed.rnd = 1
    weak = fed.sample(0.5, role="weak")
    assert len(weak) == 5 and all(int(c) % 2 for c in weak)


def test_min_clients_and_full_fraction_take_everyone_eligible() -> None:
    assert len(_sample(0, 1, fraction=0.01, min_clients=3)) == 3
    assert _sample(0, 1, fraction=1.0) == tuple(CIDS)


# ----------------------------------------------------------------------------- client streams


def _ctx(seed: int, rnd: int, cid: str) -> ClientContext:
    return ClientContext(cid, "default", rnd, seed, None, ClientState())  # type: ignore[arg-type]


def test_rng_seeds_differ_for_every_seed_round_client_and_purpose() -> None:
    grid = list(itertools.product((0, 1), (1, 2, 3), ("0", "1", "2"), ("batches", "forward")))
    seeds = [_ctx(s, r, c).rng_seed(p) for s, r, c, p in grid]
    assert len(set(seeds)) == len(grid)
    # ... and they are the documented derivation, so any runtime can recompute them.
    assert seeds == [derive_seed(s, r, c, p) for s, r, c, p in grid]
    assert _ctx(0, 1, "0").rng_seed("batches") == _ctx(0, 1, "0").rng_seed("batches")


def _draw_through_the_runner(seed: int, rnd: int, cid: str) -> list[float]:
    """Numbers a handler draws from the global torch RNG (the runtime seeds it first)."""
    kind = MessageKind("draw", up_meta=("x",))

    def handler(ctx: ClientContext, msg: Message) -> Message:
        return Message("draw", meta={"x": torch.rand(3).tolist()})

    runner = ClientRunner({"draw": handler}, {"draw": kind}, {cid: "default"}, None, seed)  # type: ignore[arg-type]
    reply, _ = runner.call(cid, rnd, ClientState(), Message("draw"))
    x = reply.meta["x"]
    assert isinstance(x, list)
    return [float(v) for v in x]


def test_the_handler_rng_differs_per_client_and_round_and_repeats() -> None:
    draws = {
        (s, r, c): tuple(_draw_through_the_runner(s, r, c))
        for s, r, c in itertools.product((0, 7), (1, 2), ("0", "1"))
    }
    assert len(set(draws.values())) == len(draws)
    torch.manual_seed(12345)  # whatever the global state was, the handler's draw is the same
    assert tuple(_draw_through_the_runner(0, 1, "0")) == draws[(0, 1, "0")]


class _Recording(toy.ToyTask):
    """The toy task, recording the seed each batch stream is shuffled with."""

    seeds: list[int]

    def batches(self, data: Any, batch_size: int, seed: int) -> Any:
        self.seeds.append(seed)
        return super().batches(data, batch_size, seed)


def test_local_training_shuffles_with_the_round_client_and_purpose() -> None:
    cfg = load_config({"task": {"kind": "toy", "num_clients": 2}, "seed": 5})
    task = _Recording(toy.ToyConfig(num_clients=2), cfg)
    task.seeds = []
    model = task.build_model()
    keys = [(1, "0", "batches"), (2, "0", "batches"), (1, "1", "batches"), (1, "0", "forward")]
    for rnd, cid, purpose in keys:
        ctx = ClientContext(cid, "default", rnd, 5, task, ClientState())
        local_round(ctx, model, TrainConfig(steps=1, lr=1e-6), purpose=purpose)
    assert task.seeds == [derive_seed(5, r, c, p) for r, c, p in keys]
    assert len(set(task.seeds)) == 4
    # Different seeds give different batch orders on the task (not only different numbers).
    data = task.client_data("0")
    orders = [next(toy.ToyTask.batches(task, data, 4, s))[1].tolist() for s in list(task.seeds)]
    assert len({tuple(o) for o in orders}) == 4


# ----------------------------------------------------------------------------- both runtimes


def _probe(tmp_path: Path, name: str, seed: int = 3) -> dict[str, Any]:
    return toy_config(
        tmp_path, "test-seed-probe", name=name, seed=seed, rounds=3, num_clients=4,
        clients={"fraction": 0.5},
    )  # fmt: skip


def _expected(seed: int, key: str) -> dict[str, Any]:
    rnd, cid = key.split("/")
    np_draw = np.random.default_rng(derive_seed(seed, int(rnd), cid, "probe")).random(2)
    return {"seed": derive_seed(seed, int(rnd), cid, "batches"), "numpy": np_draw.tolist()}


def test_the_same_seed_round_client_and_purpose_draw_the_same_on_both_runtimes(
    tmp_path: Path,
) -> None:
    emb = run(load_config(_probe(tmp_path, "emb")), progress=False)["finish"]
    opts = {"imports": ["helpers.flower", "helpers.seed_probe"]}
    flw = flower_run({**_probe(tmp_path, "flw"), "runtime": "flower"}, tmp_path / "nodes",
                      options=opts)["finish"]  # fmt: skip
    assert emb == flw  # every draw of every client in every round, exactly
    assert len(emb) == 3 * 2  # 3 rounds, half of 4 clients each
    for key, draw in emb.items():
        assert {k: draw[k] for k in ("seed", "numpy")} == _expected(3, key), key
    # Within the run, no two (round, client) pairs share a stream.
    for what in ("seed", "torch", "numpy", "batch"):
        values = [repr(d[what]) for d in emb.values()]
        assert len(set(values)) == len(values), what
    # Another run seed gives every (round, client) it samples other numbers.
    other = run(load_config(_probe(tmp_path, "other", seed=4)), progress=False)["finish"]
    for key in set(other) & set(emb):
        assert all(other[key][w] != emb[key][w] for w in ("seed", "torch", "numpy")), key


@pytest.mark.parametrize("seed", [0, 1])
def test_derive_seed_is_a_63_bit_function_of_all_its_parts(seed: int) -> None:
    a = derive_seed(seed, 1, "0", "batches")
    assert 0 <= a < 2**63
    others = [(seed, 1, "0", "forward"), (seed + 1, 1, "0", "batches"),
              (seed, 2, "0", "batches"), (seed, 1, "1", "batches")]  # fmt: skip
    assert len({a, *(derive_seed(*p) for p in others)}) == 5
