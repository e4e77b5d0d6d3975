"""DP noise from a secret only the client holds: different between two runs of one seed,
equal under ``privacy.noise: seeded`` (embedded and Flower), exact across kill -9 and resume,
never in a message; and every DP preset sends only mechanism outputs from its DP clients."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.config import load_config
from fedfm.core.audit import dp_clients, unprotected
from fedfm.core.federation import ClientState
from fedfm.core.messages import Message
from fedfm.core.secret import SECRET, SecretStream
from fedfm.engine import build
from fedfm.html_report import RunData, section_privacy, write_run_report
from fedfm.report import compare
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)
from helpers.config import toy_config
from helpers.grid import flower_run
from helpers.runfiles import untimed_rows
from helpers.runs import kill_mid_run

# The in-memory Flower grid runs in this process: it needs a task identity (conftest.py).
pytestmark = pytest.mark.usefixtures("task_identity")


def _dp_cfg(out: Path, name: str, noise: str, **kw: Any) -> dict[str, Any]:
    """Toy FedAvg under client-side DP-FedAvg: every client adds its share of the noise."""
    cfg = toy_config(out, "fedavg", name=name, rounds=kw.pop("rounds", 2), **kw)
    cfg["privacy"] = {
        "delta": 1e-3,
        "noise": noise,
        "user_level": {"clip": 0.5, "noise_multiplier": 1.0, "mode": "client", "min_clients": 2},
    }
    return cfg


def _metrics(folder: Path) -> list[dict[str, Any]]:
    return untimed_rows(folder / "metrics.jsonl")


def _keys(data: Any) -> list[str]:
    """Every client secret key anywhere in a JSON value."""
    if isinstance(data, dict):
        own = [data[SECRET]["key"]] if isinstance(data.get(SECRET), dict) else []
        return own + [k for v in data.values() for k in _keys(v)]
    if isinstance(data, list):
        return [k for v in data for k in _keys(v)]
    return []


def _secrets_in(folder: Path) -> list[str]:
    """Every client secret key kept under a folder (checkpoints, state snapshots)."""
    return [k for p in folder.rglob("*.json") for k in _keys(json.loads(p.read_text()))]


# ----------------------------------------------------------------------------- the stream


def test_a_secret_stream_is_fresh_per_state_and_continues_from_its_counter() -> None:
    a, b = ClientState(), ClientState()
    first = [SecretStream(a.meta).draw("dp") for _ in range(3)]
    assert len(set(first)) == 3  # the counter moves: no two draws share a seed
    assert SecretStream(b.meta).draw("dp") != first[0]  # another client, another key
    resumed = ClientState(meta=json.loads(json.dumps(a.meta)))  # a checkpoint round trip
    assert SecretStream(resumed.meta).draw("dp") == SecretStream(a.meta).draw("dp")
    assert a.meta[SECRET]["draws"] == 4 and len(a.meta[SECRET]["key"]) == 64


def test_dpsyn_noise_differs_between_runs_by_default_and_not_when_seeded(tmp_path: Path) -> None:
    from helpers.bases import DPSYN
    from helpers.config import make_config

    def profile(noise: str) -> torch.Tensor:
        cfg = make_config(DPSYN, tmp_path, name=f"p-{noise}")
        cfg["privacy"]["noise"] = noise
        setup = build(load_config(cfg))
        reply, state = setup.client_runner().call("0", 0, ClientState(), Message("profile"))
        assert set(reply.arrays) == {"counts"} and not reply.meta  # the key never travels
        assert (SECRET in state.meta) == (noise == "secret")  # it stays in the client's state
        return reply.arrays["counts"]["counts"]

    assert not torch.equal(profile("secret"), profile("secret"))
    assert torch.equal(profile("seeded"), profile("seeded"))


# ----------------------------------------------------------------------------- two runs


def test_two_runs_of_one_seed_differ_by_default_and_are_equal_when_seeded(tmp_path: Path) -> None:
    runs = {}
    for noise in ("secret", "seeded"):
        for i in (1, 2):
            name = f"{noise}{i}"
            run(load_config(_dp_cfg(tmp_path, name, noise)), progress=False)
            runs[name] = _metrics(tmp_path / name)
    assert runs["secret1"] != runs["secret2"]  # fresh client secrets: other noise
    assert runs["seeded1"] == runs["seeded2"]
    priv = json.loads((tmp_path / "seeded1" / "privacy.json").read_text())
    assert priv["noise"] == "seeded" and "does not hold against anyone who knows" in priv["warning"]
    assert "warning" not in json.loads((tmp_path / "secret1" / "privacy.json").read_text())
    # fedfm report and report.html say it in one line, for the seeded run only.
    table = compare([tmp_path / "seeded1", tmp_path / "secret1"])
    assert [x for x in table.splitlines() if "does not hold" in x] == [
        f"seeded1: {priv['warning']}."
    ]
    summary = json.loads((tmp_path / "seeded1" / "summary.json").read_text())
    page = write_run_report(tmp_path / "seeded1", summary).read_text()
    assert page.count("does not hold against anyone who knows the seed") == 1
    assert "Only DP mechanism outputs and public values left the 4 DP clients" in page
    # The keys are in the clients' states of the checkpoint, never in any message.
    keys = _secrets_in(tmp_path / "secret1" / "checkpoints")
    assert len(set(keys)) == 4
    audit = (tmp_path / "secret1" / "audit.jsonl").read_text()
    assert not any(k in audit for k in keys)


def test_on_the_flower_grid_too_and_seeded_equals_embedded(tmp_path: Path) -> None:
    """The in-memory Flower grid: the secret lives on each node, seeded runs are equal."""
    for name in ("a", "b"):
        flower_run(_dp_cfg(tmp_path, f"flw-secret-{name}", "secret"), tmp_path / f"nodes-{name}")
    assert _metrics(tmp_path / "flw-secret-a") != _metrics(tmp_path / "flw-secret-b")
    node_keys = _secrets_in(tmp_path / "nodes-a")
    assert len(set(node_keys)) == 4  # one per client, on its node's disk
    server_keys = _secrets_in(tmp_path / "flw-secret-a")
    assert not set(server_keys) & set(node_keys)  # the server's run folder holds none of them
    flower_run(_dp_cfg(tmp_path, "flw-seeded", "seeded"), tmp_path / "nodes-c")
    run(load_config(_dp_cfg(tmp_path, "emb-seeded", "seeded")), progress=False)
    assert _metrics(tmp_path / "flw-seeded") == _metrics(tmp_path / "emb-seeded")


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("noise", ["seeded", "secret"])
def test_kill_9_then_resume_of_a_dp_run_is_exact(tmp_path: Path, noise: str) -> None:
    """Seeded: the resumed run equals an uninterrupted one. Secret: two resumes from the same
    kill are equal (the clients' keys and counters come back from the checkpoint), while an
    uninterrupted run of the same seed draws other noise."""
    kw = {"rounds": 12, "num_clients": 6, "train": {"steps": 150, "batch_size": 8, "lr": 0.02}}
    straight = _dp_cfg(tmp_path, "straight", noise, **copy.deepcopy(kw))
    run(load_config(straight), progress=False)
    killed = _dp_cfg(tmp_path, "killed", noise, **copy.deepcopy(kw))
    kill_mid_run(killed, tmp_path / "killed")
    done = _metrics(tmp_path / "killed")
    assert 4 <= len(done) < 13
    shutil.copytree(tmp_path / "killed", tmp_path / "twin")
    run(load_config(killed), resume=True, progress=False)
    resumed = _metrics(tmp_path / "killed")
    assert resumed[: len(done) - 1] == done[: len(done) - 1]  # rounds before the kill kept
    if noise == "seeded":
        assert resumed == _metrics(tmp_path / "straight")
        return
    twin = {**killed, "name": "twin"}
    run(load_config(twin), resume=True, progress=False)
    assert _metrics(tmp_path / "twin") == resumed  # the clients' own streams, continued
    assert resumed != _metrics(tmp_path / "straight")


def test_dpsyn_resumes_its_clients_secret_streams_exactly(tmp_path: Path) -> None:
    """DP-SGD's Poisson batches and noise, profile and vote noise: secret, resumed exactly."""
    from helpers.bases import DPSYN
    from helpers.config import make_config

    def cfg(name: str, rounds: int) -> dict[str, Any]:
        c = make_config(DPSYN, tmp_path, name=name, rounds=rounds, algo__train_rounds=2)
        c["privacy"]["noise"] = "secret"
        c["algo"]["eval"] = {"enabled": False}
        return c

    run(load_config(cfg("a", 1)), progress=False)  # profile and the first DP-SGD round
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for name in ("a", "b"):  # the second DP-SGD round, generation, voting
        run(load_config(cfg(name, 4)), resume=True, progress=False)

    for art in ("synthetic_initial.jsonl", "votes.json", "profile.json"):
        assert (tmp_path / "a" / "artefacts" / art).read_bytes() == (
            tmp_path / "b" / "artefacts" / art
        ).read_bytes()
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")


# ----------------------------------------------------------------------------- DP presets


TINY_LM = {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 8}
DPSYN_TINY = [
    "task.lm=tiny-llama",
    f"task.lm_args={json.dumps(TINY_LM)}",
    "task.autocast_bf16=false",
    "task.lora={r: 4, alpha: 8, dropout: 0.0}",
    "task.max_train=120",
    "task.max_test=20",
    # 32: the drug-review prompts take up to 29 tokens; dpsyn refuses a prompt cut before its code.
    "task.prompt={max_length: 48, max_prompt_length: 32}",
    "partition.num_clients=4",
    "clients.roles={strong: 0.5}",
    "algo.train_rounds=1",
    "rounds=3",
    "algo.num_samples=8",
    "algo.embedder=hashed-ngrams",
    "algo.generation={do_sample: true, max_new_tokens: 4, batch_size: 8}",
    "algo.eval={enabled: false}",
    "train.steps=1",
    "privacy.delta=1e-3",
    "threads=1",
]
PRESETS: dict[str, list[str]] = {
    "dpsyn-rotten-tomatoes": DPSYN_TINY,
    "dpsyn-drug-reviews": DPSYN_TINY,
    "tabular-dpfedavg": [
        "partition.num_clients=40",
        "rounds=2",
        "privacy.user_level.min_clients=4",
    ],
    "fedit-dpfedavg": [
        "task.model=tiny-llama",
        f"task.model_args={json.dumps(TINY_LM)}",
        "task.autocast_bf16=false",
        "task.lora={r: 4, alpha: 8, dropout: 0.0}",
        "task.source_options={per_domain_train: 4, per_domain_test: 2, domains: [general, math]}",
        "task.prompt={max_length: 96, max_prompt_length: 64}",
        "task.max_eval=2",
        "task.max_new_tokens=2",
        "task.eval_ppl=false",
        "partition={scheme: natural}",
        "privacy.user_level.min_clients=2",
        "rounds=1",
        "train.steps=1",
        "threads=1",
    ],
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_dp_preset_sends_only_mechanism_outputs_from_its_dp_clients(
    tmp_path: Path, preset: str
) -> None:
    over = [f"out_dir={tmp_path}", "name=p", "plots=false", "eval_before=false", *PRESETS[preset]]
    run(load_config(preset, over), progress=False)
    audit = untimed_rows(tmp_path / "p" / "audit.jsonl")
    senders = {r["client"] for r in audit if r["direction"] == "up"}
    assert senders and dp_clients(audit) == senders  # every client that spoke is a DP client
    assert unprotected(audit) == []
    assert {r["privacy"] for r in audit if r["direction"] == "up"} == {"dp"}


def test_the_report_lists_in_red_what_dp_clients_sent_beyond_mechanism_outputs(
    tmp_path: Path,
) -> None:
    """FedHDS's DP option, say: noised centroids, but an unnoised count and adapter."""

    def row(client: str, kind: str, field: str, privacy: str | None) -> dict[str, Any]:
        out = {"round": 1, "client": client, "kind": kind, "direction": "up", "field": field}
        return {**out, "type": "meta", "bytes": 4, **({"privacy": privacy} if privacy else {})}

    audit = [
        row("0", "select", "centroids", "dp"),
        row("0", "select", "num_examples", "none"),
        row("0", "train", "adapter", None),
        row("1", "train", "adapter", None),  # client 1 ran no DP mechanism: not a DP client
    ]
    assert dp_clients(audit) == {"0"}
    assert unprotected(audit) == [
        {"kind": "select", "field": "num_examples", "clients": 1, "rounds": [1]},
        {"kind": "train", "field": "adapter", "clients": 1, "rounds": [1]},
    ]
    priv = {"run": {"epsilon": 3.0, "worst_client": "0"}, "relation": "add or remove one record"}
    data = RunData(tmp_path, "hds", {}, "", [], audit=audit, privacy=priv)
    page = section_privacy([data])
    red = page[page.index('<p class="bad">') :]
    assert "num_examples" in red and "adapter" in red and "centroids" not in red
