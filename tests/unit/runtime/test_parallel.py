"""Clients side by side in forked workers (``clients.parallel``): a run equals the sequential
run file for file (metrics, audit log, failures, checkpoints), DP noise streams stay per
client, a worker that dies is a failed client, and the value is checked at load."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedfm.algorithms.base import ALGORITHMS, ClientHalf
from fedfm.config import load_config, preset_dir
from fedfm.core.federation import ClientContext
from fedfm.core.messages import Message
from fedfm.core.secret import SECRET
from fedfm.errors import ConfigError
from fedfm.runtime import run
from fedfm.runtime.workers import MMAP_THRESHOLD, WorkerFailed, side_by_side
from helpers import flower  # registers the toy task, test-two-phase, test-crashy
from helpers.config import TINY_LLAMA, toy_config
from helpers.runfiles import jsonl_rows, untimed_rows


def _run_files(folder: Path) -> dict[str, Any]:
    """What two runs of one seed must share: untimed logs and every checkpoint's content."""
    files: dict[str, Any] = {
        name: untimed_rows(folder / name) for name in ("metrics.jsonl", "failures.jsonl")
    }
    files["audit"] = jsonl_rows(folder / "audit.jsonl")
    for ck in sorted((folder / "checkpoints").glob("round_*")):
        files[ck.name] = json.loads((ck / "meta.json").read_text())
        for part in ("server", "clients"):
            tensors = load_file(str(ck / f"{part}.safetensors"))
            files[f"{ck.name}/{part}"] = {k: v.tolist() for k, v in sorted(tensors.items())}
    return files


def _both(tmp_path: Path, cfg: dict[str, Any], workers: int = 2) -> tuple[dict, dict]:
    """The run files of ``cfg`` run sequentially and with ``workers`` workers, each from the
    global RNG state of a fresh process (checkpoints record it)."""
    out = {}
    for parallel in (1, workers):
        torch.manual_seed(67280421310721)  # torch's default seed
        name = f"{cfg['name']}-{parallel}"
        run(load_config({**cfg, "name": name, "clients": {**cfg.get("clients", {}),
                         "parallel": parallel}}), progress=False)  # fmt: skip
        out[parallel] = _run_files(tmp_path / name)
    return out[1], out[workers]


def test_the_quickstart_twin_in_workers_equals_the_sequential_run(tmp_path: Path) -> None:
    """The quickstart preset with a tiny random Llama for SmolLM2, at test size."""
    cfg = yaml.safe_load((preset_dir() / "quickstart.yaml").read_text())
    task = cfg["task"]
    task.update(model="tiny-llama", model_args={**TINY_LLAMA, "layers": 1}, max_eval=5)
    task.update(max_new_tokens=3, eval_batch_size=8)
    task["source_options"].update(per_domain_train=6, per_domain_test=1)
    task["prompt"] = {"max_length": 64, "max_prompt_length": 48}
    cfg.update(out_dir=str(tmp_path), plots=False, threads=1, eval_every=1)
    cfg["train"] = {**cfg["train"], "steps": 2}
    sequential, parallel = _both(tmp_path, cfg, workers=3)
    assert sequential["metrics.jsonl"][-1]["clients"] == 4  # every domain's client trained
    assert parallel == sequential


def test_secret_dp_noise_stays_per_client_in_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client-side DP-FedAvg with secret noise: each client's key and draw counter live in its
    state and come back from its worker. The keys are made reproducible here (from the seed
    dispatch gave the client's call) so that the two runs can be compared at all."""
    monkeypatch.setattr(
        "fedfm.core.secret.secrets.token_hex",
        lambda n: hashlib.sha256(str(torch.initial_seed()).encode()).hexdigest()[: 2 * n],
    )
    cfg = toy_config(tmp_path, "fedavg", name="dp", rounds=3, threads=1)
    cfg["privacy"] = {
        "delta": 1e-3,
        "noise": "secret",
        "user_level": {"clip": 0.5, "noise_multiplier": 1.0, "mode": "client", "min_clients": 2},
    }
    sequential, parallel = _both(tmp_path, cfg)
    assert parallel == sequential
    clients = parallel["round_0003"]["clients"]
    secrets = {cid: meta[SECRET] for cid, meta in clients.items()}
    assert len(secrets) == 4 and {s["draws"] for s in secrets.values()} == {3}
    assert len({s["key"] for s in secrets.values()}) == 4  # one stream per client


def test_any_exchange_and_failures_in_workers_equal_the_sequential_run(tmp_path: Path) -> None:
    """Several exchanges per round, roles, client state, the torch RNG drawn in handlers
    (test-two-phase); clients failing in every way a reply can (test-crashy)."""
    six = {"task": {"kind": "toy", "num_clients": 6}}
    roles = {"roles": {"strong": 0.5}}
    two = toy_config(tmp_path, "test-two-phase", rounds=2, clients=roles, threads=1, **six)
    sequential, parallel = _both(tmp_path, two, workers=4)
    assert parallel == sequential
    crashy = toy_config(tmp_path, "test-crashy", rounds=1, clients={"min_clients": 2}, **six)
    sequential, parallel = _both(tmp_path, crashy)
    assert len(parallel["failures.jsonl"]) == 4 and parallel == sequential


class KilledClient(ClientHalf):
    """Client 1's worker is killed (as by the OOM killer) in round 1; the others answer."""

    def handlers(self) -> dict[str, Any]:
        def train(ctx: ClientContext, msg: Message) -> Message:
            ctx.state.meta["rounds"] = ctx.state.meta.get("rounds", 0) + 1
            if ctx.cid == "1" and ctx.rnd == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return Message("train", {"p": {"w": msg.arrays["p"]["w"] + 1}})

        return {"train": train}


class Killed(flower.Crashy):
    """Averages the replies of whoever answered (the crashing test algorithm's server half)."""

    Client = KilledClient


if "test-killed" not in ALGORITHMS:
    ALGORITHMS.register("test-killed")(Killed)


def test_a_killed_worker_is_a_failed_client_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = toy_config(
        tmp_path, "test-killed", rounds=2, threads=1, clients={"min_clients": 3, "parallel": 2}
    )
    run(load_config(cfg), progress=False)
    files = _run_files(tmp_path / "test-killed")
    assert [r["ok"] for r in files["metrics.jsonl"][1:]] == [3, 4]
    assert files["failures.jsonl"] == [
        {
            "round": 1,
            "client": "1",
            "kind": "train",
            "error": "its worker process was killed by SIGKILL",
        }
    ]
    # The dead client's state was not committed: it counts one round, the others two.
    rounds = {cid: m["rounds"] for cid, m in files["round_0002"]["clients"].items()}
    assert rounds == {"0": 2, "1": 1, "2": 2, "3": 2}


def test_workers_run_under_the_live_progress_display(tmp_path: Path) -> None:
    """The display's refresh thread owns the proxies of stdout/stderr; workers that print and
    warn under it write to the streams beneath and finish."""
    cfg = toy_config(tmp_path, "test-two-phase", rounds=2, threads=1, clients={"parallel": 2})
    run(load_config(cfg), progress=True)
    assert len(untimed_rows(tmp_path / "test-two-phase" / "metrics.jsonl")) == 3


def test_side_by_side_hands_results_on_in_order_and_kills_the_rest_when_closed() -> None:
    jobs = [lambda i=i: i * i for i in range(5)]
    jobs[2] = lambda: 1 / 0
    out = list(side_by_side(jobs, workers=3, threads=1))
    assert out[:2] + out[3:] == [0, 1, 9, 16]
    assert isinstance(out[2], WorkerFailed) and str(out[2]) == "ZeroDivisionError: division by zero"
    it = side_by_side([lambda: 0, lambda: os.kill(os.getpid(), signal.SIGSTOP)], 2, 1)
    assert next(it) == 0
    it.close()  # the stopped worker is killed and reaped, not left behind


def _mapped_after_a_large_free() -> bool:
    """Whether glibc maps a 3 MiB block after a 20 MiB one was freed (mallinfo2's count)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ["a", "b", "c", "d", "mapped", *"efghi"]]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(20 << 20))  # glibc's own rule raises its threshold to this size
    before = libc.mallinfo2().mapped
    block = libc.malloc(3 << 20)
    mapped = libc.mallinfo2().mapped - before >= 3 << 20
    libc.free(block)
    return bool(mapped)


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="glibc")
def test_a_worker_maps_its_large_allocations_where_the_server_takes_them_from_the_heap() -> None:
    # In a fresh process: glibc applies the mmap threshold only where no free block of the
    # heap fits, and the suite's long-lived process has freed large blocks inside its heap
    # (which a forked worker inherits), so there a 3 MiB block came from the heap in the
    # worker too.
    import subprocess
    import sys

    code = (
        "import os, sys; sys.path[:0] = ['tests', 'tests/unit/runtime']\n"
        "import test_parallel as t\n"
        "from fedfm.runtime.workers import side_by_side\n"
        "(w,) = side_by_side([t._mapped_after_a_large_free], workers=1, threads=1)\n"
        "pid = os.fork()\n"
        "if pid == 0: os._exit(0 if t._mapped_after_a_large_free() is False else 1)\n"
        "plain = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "print(w, plain)\n"
    )
    assert MMAP_THRESHOLD < 3 << 20
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split()[-2:] == ["True", "0"], out.stderr[-2000:]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"clients": {"parallel": 0}}, "clients.parallel"),
        ({"clients": {"parallel": "many"}}, "clients.parallel"),
        (
            {"clients": {"parallel": 2}, "runtime": "flower-sim"},
            "clients.parallel: worker processes are the embedded runtime's",
        ),
    ],
)
def test_parallel_is_checked_at_load(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(toy_config(tmp_path, "fedavg", **changes))
    assert load_config(toy_config(tmp_path, clients={"parallel": "auto"})).clients.parallel


# ----------------------------------------------------------------------------- the plan


def test_the_plan_counts_each_workers_training_memory_and_auto_fits_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm import devices, plan
    from fedfm.engine import build
    from helpers.bases import INSTRUCTION
    from helpers.config import make_config

    assert plan.fit_workers(8, 100, 350) == 3 and plan.fit_workers(2, 100, 10**6) == 2
    assert plan.fit_workers(8, 100, 50) == 1  # one client at a time always runs
    monkeypatch.setattr(plan, "_rss", lambda: 0)  # no measured data: equal plans
    # batches of 16: three workers' training memory above one evaluation's (the branch tested)
    big = {"train": {"batch_size": 16}}
    made = {
        p: plan.make_plan(
            load_config(make_config(INSTRUCTION, tmp_path, clients={"parallel": p}, **big))
        )
        for p in (1, 3)
    }
    one, three = made[1], made[3]
    training = one.client.peak - one.client.parts["weights"]
    evaluation = one.server.parts["evaluation"]
    base = one.server.peak - evaluation
    assert three.workers == 3 and one.workers == 1 and 3 * training > evaluation
    assert one.process == base + max(evaluation, training)
    assert three.process == base + 3 * training  # each worker its own training memory
    assert "3 trained at once in worker processes" in three.summary()
    # auto: as many workers as cores and sampled clients, no more than the memory holds.
    monkeypatch.setattr(devices, "cores", lambda: 16)
    auto = load_config(make_config(INSTRUCTION, tmp_path, clients={"parallel": "auto"}, **big))
    assert plan.make_plan(auto).workers == 3  # three sampled clients (one per domain)
    free = base + 2 * training + training // 2
    monkeypatch.setattr(devices, "memory_available", lambda device: free)
    fitted = plan.make_plan(auto)
    assert fitted.workers == 2 and fitted.fits
    monkeypatch.setattr(devices, "cores", lambda: 2)
    monkeypatch.setattr(devices, "memory_available", lambda device: 10 * training)
    assert plan.make_plan(auto).workers == 2  # no more workers than cores
    # In a run the weights are loaded already: the memory free now is the workers'.
    setup = build(auto)
    assert plan.parallel_workers(auto, setup.task) == 2
    monkeypatch.setattr(devices, "memory_available", lambda device: int(1.5 * training))
    assert plan.parallel_workers(auto, setup.task) == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "error: config error: clients.parallel: must be auto or a number of worker"),
        ("some", "clients.parallel"),
    ],
)
def test_a_bad_parallel_on_the_command_line_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    value: str, expected: str,
) -> None:  # fmt: skip
    from helpers.cli import run_cli

    args = ["run", "tabular-fedavg", "rounds=1", f"out_dir={tmp_path}", f"clients.parallel={value}"]
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().lower().startswith(expected.lower()) or expected in err
    assert not list(tmp_path.iterdir())  # nothing written
