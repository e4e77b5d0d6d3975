"""FedeKD and its baselines through the engine: privacy of the private models, resume, bad input."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

import fedfm.algorithms.fedekd as fedekd
from fedfm.algorithms.base import ALGORITHMS
from fedfm.config import load_config
from fedfm.core.checkpoint import latest_checkpoint, load_checkpoint
from fedfm.core.messages import Message
from fedfm.core.train import get_params
from fedfm.data.sources import (
    SOURCES,
    LoadedSource,
    SourceInfo,
    register_source,
    source_info,
)
from fedfm.data.sources.tabular import tabular_from_frame
from fedfm.engine import Engine, build
from fedfm.errors import ConfigError
from fedfm.runtime import run as run_experiment
from fedfm.runtime.embedded import embedded_federation
from helpers.config import make_config
from helpers.runfiles import jsonl_rows

PRIVATE = [{"hidden": [32, 32]}, {"hidden": [48]}]
PROXY = {"hidden": [8]}


# FedeKD on breast cancer: four IID clients, two private architectures and a small proxy.
FEDEKD: dict[str, Any] = {
    "seed": 0,
    "rounds": 2,
    "algorithm": "fedekd",
    "plots": False,
    "algo": {"proxy_arch": PROXY, "private_archs": PRIVATE},
    "task": {"kind": "tabular", "dataset": "breast_cancer", "model_args": {"hidden": [16]}},
    "partition": {"scheme": "iid", "num_clients": 4},
    "train": {"steps": 2, "batch_size": 16, "optimizer": "adam", "lr": 0.01},
}


def _run(out: Path, **changes: Any) -> dict[str, Any]:
    """Runs FedeKD's base with ``changes`` on the embedded runtime (``resume`` passed on)."""
    resume = changes.pop("resume", False)
    cfg = load_config(make_config(FEDEKD, out, **changes))
    return run_experiment(cfg, resume=resume, progress=False)


def _client_states(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Client id -> state tensors of the run's last checkpoint (stored flat as ``cid::key``)."""
    ck = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in ck.client_arrays.items():
        cid, k = key.split("::", 1)
        out.setdefault(cid, {})[k] = v
    return out


def _numel_bytes(arrays: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in arrays.values())


@pytest.fixture(scope="module")
def fedekd_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedekd")
    summary = _run(tmp, name="run")
    return tmp / "run", summary


# ----------------------------------------------------------------------------- privacy


def test_only_the_proxy_travels_private_weights_never_in_the_audit(fedekd_run):
    run, _ = fedekd_run
    setup = build(load_config(str(run / "config.yaml")))
    proxy_bytes = _numel_bytes(get_params(setup.algo.proxy_model()))
    instances = setup.client.privates.instances  # the client half's private architectures
    private_bytes = {_numel_bytes(get_params(instances[i])) for i in range(2)}
    assert proxy_bytes not in private_bytes  # sizes tell the two apart
    rows = jsonl_rows(run / "audit.jsonl")
    arrays = [r for r in rows if r["type"] == "arrays"]
    assert arrays, "the proxy should travel"
    assert {r["field"] for r in arrays} == {"proxy"}
    assert {r["bytes"] for r in arrays} == {proxy_bytes}
    # Forward: proxy down and up; backward: proxy down only; evaluate: no tensors at all.
    by_kind = {(r["kind"], r["direction"]) for r in arrays}
    assert by_kind == {("forward", "down"), ("forward", "up"), ("backward", "down")}
    assert not any("private" in r["field"] for r in rows)
    # The private models exist, in the client state that stays on each client.
    private_keys = [k for k in _client_states(run)["0"] if k.startswith("private/")]
    assert private_keys and "private/body.0.weight" in private_keys


def test_private_architectures_differ_per_client(fedekd_run):
    run, _ = fedekd_run
    states = _client_states(run)
    shapes = {c: tuple(a["private/body.0.weight"].shape) for c, a in states.items()}
    # private_archs is cycled over clients 0, 1, 2, 3: [32, 32], [48], [32, 32], [48].
    assert shapes == {"0": (32, 30), "1": (48, 30), "2": (32, 30), "3": (48, 30)}
    assert "private/body.2.weight" in states["0"]
    assert "private/body.2.weight" not in states["1"]
    # Two clients with the same architecture start from different client-derived seeds.
    assert not torch.equal(states["0"]["private/head.weight"], states["2"]["private/head.weight"])


def test_personalised_metrics_per_client(fedekd_run):
    run, summary = fedekd_run
    last = jsonl_rows(run / "client_metrics.jsonl")[-1]
    assert last["round"] == 2 and set(last["clients"]) == {"0", "1", "2", "3"}
    for m in last["clients"].values():
        assert {"local/acc", "local/macro_f1", "test/acc", "test/macro_f1"} <= set(m)
    final = summary["final"]
    assert {"acc", "local/acc/worst", "proxy/acc", "energy", "gate_min"} <= set(final)
    assert final["local/acc/worst"] <= final["local/acc"]
    assert final["local/loss/worst"] >= final["local/loss"]  # worst loss is the largest
    assert 0.0 < final["gate_min"] <= final["gate_max"] < 1.0


# ----------------------------------------------------------------------------- resume


def test_resume_with_private_state_equals_uninterrupted_run(tmp_path):
    _run(tmp_path, name="straight", rounds=4)
    _run(tmp_path, name="cut", rounds=2)
    assert latest_checkpoint(tmp_path / "cut" / "checkpoints").name.endswith("0002")
    assert any(k.startswith("private/") for k in _client_states(tmp_path / "cut")["1"])
    _run(tmp_path, name="cut", rounds=4, resume=True)
    a = jsonl_rows(tmp_path / "straight" / "client_metrics.jsonl")
    b = jsonl_rows(tmp_path / "cut" / "client_metrics.jsonl")
    assert [r["round"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b
    ra = [
        {k: v for k, v in r.items() if k != "time_s"}
        for r in jsonl_rows(tmp_path / "straight" / "metrics.jsonl")
    ]
    rb = [
        {k: v for k, v in r.items() if k != "time_s"}
        for r in jsonl_rows(tmp_path / "cut" / "metrics.jsonl")
    ]
    assert ra == rb


# ----------------------------------------------------------------------------- bad input


class _MismatchedProxyClient(fedekd.FedeKDClient):
    """Client 1 is configured with another proxy architecture."""

    def forward(self, ctx, msg):
        if ctx.cid != "1":
            return super().forward(ctx, msg)
        other = self.task.build_model(seed=0, hidden=[12])
        return Message("forward", {"proxy": get_params(other)}, {"num_examples": 1, "loss": 0.0})


class _MismatchedProxy(fedekd.FedeKD):
    """FedeKD whose client 1 sends a proxy of another architecture."""

    Client = _MismatchedProxyClient


if "test-fedekd-mismatch" not in ALGORITHMS:
    ALGORITHMS.register("test-fedekd-mismatch")(_MismatchedProxy)


def test_mismatched_proxy_is_refused_by_name(tmp_path):
    cfg = load_config(
        make_config(FEDEKD, tmp_path, name="mismatch", algorithm="test-fedekd-mismatch", rounds=1)
    )
    run_experiment(cfg, progress=False)
    fails = jsonl_rows(tmp_path / "mismatch" / "failures.jsonl")
    assert [(f["client"], f["kind"]) for f in fails] == [("1", "forward")]
    assert (
        "update rejected: client 1: field proxy.body.0.weight: shape (12, 30)" in fails[0]["error"]
    )
    # The refused client is left out of the round: it never gets the backward message.
    audit = jsonl_rows(tmp_path / "mismatch" / "audit.jsonl")
    assert {r["client"] for r in audit if r["kind"] == "backward" and r["round"] == 1} == {
        "0",
        "2",
        "3",
    }


def test_config_refuses_per_client_proxy_architectures(tmp_path):
    cfg = load_config(
        make_config(
            FEDEKD, tmp_path, name="x", algo={"proxy_arch": [{"hidden": [8]}, {"hidden": [16]}]}
        )
    )
    with pytest.raises(
        ConfigError, match=r"algo\.proxy_arch: .*one architecture shared by every client"
    ):
        Engine(cfg, embedded_federation, progress=False)


def test_config_refuses_unknown_gate_and_bad_beta(tmp_path):
    with pytest.raises(ConfigError, match=r"algo\.gate: unknown gate 'hard'"):
        Engine(
            load_config(make_config(FEDEKD, tmp_path, name="x", algo={"gate": "hard"})),
            embedded_federation,
            progress=False,
        )
    with pytest.raises(ConfigError, match=r"algo\.beta"):
        Engine(
            load_config(make_config(FEDEKD, tmp_path, name="x", algo={"beta": -1})),
            embedded_federation,
            progress=False,
        )
    with pytest.raises(ConfigError, match=r"algo\.gate"):
        Engine(
            load_config(
                make_config(
                    FEDEKD, tmp_path, name="x", algorithm="fedkd-ungated", algo={"gate": "sigmoid"}
                )
            ),
            embedded_federation,
            progress=False,
        )


# ----------------------------------------------------------------------------- baselines


def test_beta_zero_equals_ungated_and_local_private_matches_lambda_zero(tmp_path):
    _run(tmp_path, name="b0", rounds=1, algo={"beta": 0.0})
    _run(tmp_path, name="ung", algorithm="fedkd-ungated", rounds=1)
    a = jsonl_rows(tmp_path / "b0" / "client_metrics.jsonl")[-1]["clients"]
    b = jsonl_rows(tmp_path / "ung" / "client_metrics.jsonl")[-1]["clients"]
    for c in a:
        assert a[c]["local/loss"] == pytest.approx(b[c]["local/loss"], rel=1e-4)
    # Local-only with private architectures = FedeKD's backward stage without distillation.
    _run(tmp_path, name="lam0", rounds=1, algo={"lam": 0.0})
    _run(tmp_path, name="lp", algorithm="local-private", rounds=1)
    a = jsonl_rows(tmp_path / "lam0" / "client_metrics.jsonl")[-1]["clients"]
    b = jsonl_rows(tmp_path / "lp" / "client_metrics.jsonl")[-1]["clients"]
    assert a == b
    assert not [r for r in jsonl_rows(tmp_path / "lp" / "audit.jsonl") if r["type"] == "arrays"]


# ----------------------------------------------------------------------------- regression + NaN

NAN_SOURCE = "test-fedekd-nan-regression"
NAN_TARGET_ROWS = [3, 17, 40, 41, 77, 90, 111]
NAN_FEATURE_ROWS = [5, 60, 100]


def _nan_regression() -> LoadedSource:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4))
    frame = pd.DataFrame(x, columns=["f0", "f1", "f2", "f3"])
    frame["y"] = x @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * rng.normal(size=120)
    frame.loc[NAN_TARGET_ROWS, "y"] = np.nan
    frame.loc[NAN_FEATURE_ROWS, "f0"] = np.nan
    tf = tabular_from_frame(frame, "y", regression=True, source=NAN_SOURCE)
    return LoadedSource(source_info(NAN_SOURCE), tf.dataset, None, None, None, tf.feature_names)


if NAN_SOURCE not in SOURCES:
    register_source(
        SourceInfo(NAN_SOURCE, "tabular-regression", "none", "n/a", "120 rows, 10 with NaN")
    )(_nan_regression)


def test_regression_with_nan_rows_dropped_and_counted(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fedfm.data")
    cfg = load_config(
        make_config(
            FEDEKD,
            tmp_path,
            name="nan",
            task={"dataset": NAN_SOURCE, "test_fraction": 0.25},
            partition={"scheme": "quantity", "alpha": 1.0, "num_clients": 3, "min_size": 5},
        )
    )
    summary = run_experiment(cfg, progress=False)
    assert f"{NAN_SOURCE}: dropped 10 of 120 rows with a missing numeric feature or target" in (
        caplog.text
    )
    setup = build(cfg)
    task = setup.task
    kept = len(task.test_data()) + sum(
        len(task.client_data(c)) + len(task.client_test_data(c)) for c in task.client_ids()
    )
    assert kept == 110
    ids = torch.cat([task.test_data().ids] + [task.client_data(c).ids for c in task.client_ids()])
    assert not set(ids.tolist()) & set(NAN_TARGET_ROWS + NAN_FEATURE_ROWS)
    assert task.kind == "regression" and summary["primary"] == "rmse"
    final = summary["final"]
    assert np.isfinite(final["rmse"]) and np.isfinite(final["local/rmse"])
    assert final["local/rmse/worst"] >= final["local/rmse"]
    assert final["energy"] >= 0  # half squared error energy


def test_image_task_with_private_cnns_of_different_widths(tmp_path):
    cfg = load_config(
        make_config(
            FEDEKD,
            tmp_path,
            name="cnn",
            rounds=1,
            algo={
                "proxy_arch": {"width": 2, "hidden": 8},
                "private_archs": [{"width": 4, "hidden": 16}, {"width": 6, "hidden": 16}],
            },
            task={"kind": "image", "dataset": "digits", "model": "small-cnn", "model_args": {}},
            partition={"num_clients": 3},
            train={"steps": 1},
        )
    )
    summary = run_experiment(cfg, progress=False)
    states = _client_states(tmp_path / "cnn")
    widths = {c: s["private/conv.0.weight"].shape[0] for c, s in states.items()}
    assert widths == {"0": 4, "1": 6, "2": 4}
    proxy_rows = [r for r in jsonl_rows(tmp_path / "cnn" / "audit.jsonl") if r["type"] == "arrays"]
    assert {r["field"] for r in proxy_rows} == {"proxy"}
    assert 0.0 <= summary["final"]["proxy/acc"] <= 1.0


# ----------------------------------------------------------------------------- presets, study


@pytest.mark.parametrize(
    "preset", ["breast-cancer", "credit", "covid", "digits", "concrete", "diabetes"]
)
def test_presets_validate(preset):
    from fedfm.engine import resolve

    cfg = load_config(f"fedekd-{preset}")
    algo_cfg, _ = resolve(cfg)
    assert cfg.algorithm == "fedekd" and len(algo_cfg.private_archs) >= 2
    assert cfg.partition["scheme"] == "dirichlet" and cfg.partition["num_clients"] >= 10
