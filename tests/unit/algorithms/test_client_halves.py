"""Client halves are built from the config alone: a handler that reads server state fails
the same way on every runtime; variants that set part of a config are presets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf, ServerStateError
from fedfm.algorithms.fedavg import TRAIN, FedAvg
from fedfm.algorithms.fedekd import FedeKD
from fedfm.algorithms.presets import register_preset
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message
from fedfm.engine import build, resolve
from fedfm.errors import ConfigError, TooFewClientsError
from helpers import toy  # noqa: F401  (registers the toy task)
from helpers.config import toy_config
from helpers.grid import embedded_run, flower_run
from helpers.runfiles import untimed_rows


class ReadsServerClient(ClientHalf):
    """Sends back the global parameters it finds on itself, as a handler bound to the server
    half could: on the embedded runtime that object would hold the server's latest
    parameters, on Flower the ones it was built with."""

    def handlers(self) -> dict[str, Any]:
        return {"train": self.train}

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        params = self.params  # the mistake: server state, not the message's
        return Message("train", {"params": params}, {"num_examples": 1, "loss": 0.0})


class ReadsServer(Algorithm):
    """One exchange per round of the global ``params``, which the server half holds."""

    Client = ReadsServerClient
    messages = (TRAIN,)

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.params = {"w": torch.zeros(2)}

    def round(self, fed: Federation) -> dict[str, float]:
        cids = fed.client_ids()
        replies = fed.broadcast(Message("train", {"params": self.params}), cids)
        self.require(fed, replies, len(cids))
        return {"clients": len(replies)}


if "test-reads-server" not in ALGORITHMS:
    ALGORITHMS.register("test-reads-server", "a client half that reads server state")(ReadsServer)

WHY = (
    "client half ReadsServerClient has no attribute 'params': a client half holds only what it"
    " built from the config (cfg, task, run); server state reaches a client in its message"
)


@pytest.mark.usefixtures("task_identity")
def test_a_client_half_reading_server_state_fails_alike_on_embedded_and_flower(
    tmp_path: Path,
) -> None:
    cfg = toy_config(tmp_path, "test-reads-server", name="emb", rounds=1, num_clients=3)
    stop = "round 1: only 0 of 3 clients answered"
    with pytest.raises(TooFewClientsError, match=stop):
        embedded_run(cfg)
    with pytest.raises(TooFewClientsError, match=stop):
        flower_run({**cfg, "name": "flw"}, tmp_path / "nodes")
    emb = untimed_rows(tmp_path / "emb" / "failures.jsonl")
    flw = untimed_rows(tmp_path / "flw" / "failures.jsonl")
    assert emb == flw
    assert [(f["client"], f["kind"], f["error"]) for f in emb] == [
        (c, "train", WHY) for c in ("0", "1", "2")
    ]


def test_every_built_client_half_is_apart_from_its_server_half(tmp_path: Path) -> None:
    setup = build(load_config(toy_config(tmp_path, "fedavg")))
    assert isinstance(setup.algo, FedAvg)
    held = list(vars(setup.client).values())
    assert not any(isinstance(v, Algorithm) for v in held)
    with pytest.raises(ServerStateError, match="has no attribute 'params'"):
        setup.client.params  # noqa: B018
    with pytest.raises(ServerStateError, match="has no attribute 'opt'"):
        setup.client.opt  # noqa: B018
    # The scratch model is shared (one instance per process), its tensors are not state.
    assert setup.client.model is setup.algo.model()
    assert not hasattr(setup.client, "__wrapped__")  # dunders stay plain AttributeErrors


def test_handlers_on_the_server_half_are_refused_where_the_class_is_written() -> None:
    with pytest.raises(TypeError, match=r"Bound\.handlers: client handlers belong to the client"):

        class Bound(Algorithm):
            def handlers(self) -> dict[str, Any]:
                return {}


def test_a_preset_runs_its_base_with_its_values_and_refuses_to_change_a_fixed_one(
    tmp_path: Path,
) -> None:
    if "test-fedavgm-median" not in ALGORITHMS:
        register_preset(
            "test-fedavgm-median",
            "fedavg",
            "FedAvgM with the median",
            fixed={"aggregator": {"name": "median"}},
            server_opt={"name": "fedavgm", "momentum": 0.5},
        )
    assert ALGORITHMS.get("test-fedavgm-median") is FedAvg
    algo_cfg, _ = resolve(load_config(toy_config(tmp_path, "test-fedavgm-median")))
    assert algo_cfg.aggregator.name == "median"
    assert (algo_cfg.server_opt.name, algo_cfg.server_opt.momentum) == ("fedavgm", 0.5)
    mine = toy_config(tmp_path, "test-fedavgm-median", algo={"server_opt": {"name": "fedadam"}})
    assert resolve(load_config(mine))[0].server_opt.name == "fedadam"  # a default yields
    same = toy_config(tmp_path, "test-fedavgm-median", algo={"aggregator": {"name": "median"}})
    assert resolve(load_config(same))[0].aggregator.name == "median"
    other = toy_config(tmp_path, "test-fedavgm-median", algo={"aggregator": {"name": "krum"}})
    with pytest.raises(ConfigError, match=r"algo\.aggregator: algorithm 'test-fedavgm-median'"
                       r" is fedavg with aggregator=\{'name': 'median'\}"):  # fmt: skip
        resolve(load_config(other))


def test_fedkd_ungated_is_fedekd_with_the_ungated_gate(tmp_path: Path) -> None:
    from helpers.flower import algorithm_config

    assert ALGORITHMS.get("fedkd-ungated") is FedeKD
    cfg = algorithm_config(tmp_path, "fedkd-ungated")
    assert cfg is not None
    del cfg["algo"]["gate"]  # the preset's own value
    assert resolve(load_config(cfg))[0].gate == "ungated"


def test_a_flower_client_process_builds_the_client_half_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm.core.federation import ClientState
    from fedfm.engine import ClientSide, Setup
    from fedfm.runtime.flower.client import ClientRuntime
    from helpers.grid import grid_payload

    made: list[str] = []
    real = Algorithm.__init__

    def counted(self: Algorithm, *args: Any, **kwargs: Any) -> None:
        made.append(type(self).__name__)
        real(self, *args, **kwargs)

    monkeypatch.setattr(Algorithm, "__init__", counted)
    cfg = toy_config(tmp_path, "fedavg")
    build(load_config(cfg))
    assert made == ["FedAvg"]  # the embedded runtime and the ServerApp build both halves
    rt = ClientRuntime(grid_payload(cfg))
    assert made == ["FedAvg"]  # ... a ClientApp's process no server half
    assert isinstance(rt.setup, ClientSide) and not isinstance(rt.setup, Setup)
    params = {k: v.clone() for k, v in rt.setup.client.model.state_dict().items()}
    reply, _ = rt.runner.call("0", 1, ClientState(), Message("train", {"params": params}))
    assert set(reply.arrays["params"]) == set(params) and reply.meta["num_examples"] == 24
