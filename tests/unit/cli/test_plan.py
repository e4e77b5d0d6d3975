"""``fedfm plan``: parameter counts and traffic equal the real run's, the estimate's parts
scale as they should, and a run that does not fit warns or (``--strict``) is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fedfm import devices
from fedfm.config import load_config
from fedfm.engine import build
from fedfm.plan import make_plan
from fedfm.runtime import run
from helpers.bases import tiny_task
from helpers.cli import run_cli
from helpers.config import make_config

TINY = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 4}


PLAN: dict[str, Any] = {
    "name": "p",
    "rounds": 1,
    "eval_before": False,
    "plots": False,
    "task": tiny_task(
        TINY,
        model="tiny-qwen2",
        source_options={"per_domain_train": 3, "per_domain_test": 1},
        lora={"r": 4, "alpha": 8, "target_modules": "auto"},
        prompt={"max_length": 64, "max_prompt_length": 48},
        max_eval=2,
        max_new_tokens=2,
    ),
    "train": {"steps": 1, "batch_size": 2, "optimizer": "adamw", "lr": 1e-3},
}


def test_counts_and_traffic_equal_the_real_model_and_the_audit_ledger(tmp_path) -> None:
    cfg = load_config(make_config(PLAN, tmp_path))
    plan = make_plan(cfg)
    fm = build(cfg).task.foundation_model()
    assert plan.client.frozen == sum(
        p.numel() for p in fm.model.parameters() if not p.requires_grad
    )
    adapter = fm.get_adapter("default")
    assert plan.client.trainable == sum(v.numel() for v in adapter.values())
    summary = run(cfg, progress=False)
    assert plan.clients == plan.sampled == 6  # the suite's six domains, all sampled
    assert summary["bytes_up_arrays"] == plan.sampled * plan.up  # the ledger's figure
    assert summary["bytes_down_arrays"] == plan.sampled * plan.down
    assert plan.fits and "fits" in plan.summary()


def test_activations_grow_with_the_batch_and_quantisation_shrinks_the_weights(tmp_path) -> None:
    small = make_plan(load_config(make_config(PLAN, tmp_path)))
    big = make_config(PLAN, tmp_path)
    big["train"]["batch_size"] = 4
    double = make_plan(load_config(big))
    # the layers' activations double; the head's logits exist a chunk of rows at a time
    assert small.client.parts["activations"] < double.client.parts["activations"]
    assert double.client.parts["activations"] < 2 * small.client.parts["activations"]
    assert double.client.parts["weights"] == small.client.parts["weights"]
    from fedfm.plan import _llm_shape, _weight_bytes

    shape = _llm_shape(build_task_cfg(tmp_path))
    fp32 = _weight_bytes(shape, 4, None)
    assert _weight_bytes(shape, 4, "4bit") < _weight_bytes(shape, 4, "8bit") < fp32


def build_task_cfg(tmp_path: Path) -> Any:
    from fedfm.engine import resolve

    return resolve(load_config(make_config(PLAN, tmp_path)))[1]


def test_plan_prints_the_parts_and_strict_refuses_what_does_not_fit(
    tmp_path, monkeypatch, capsys, caplog
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(make_config(PLAN, tmp_path / "runs")))
    code, out, _ = run_cli(["plan", str(path)], monkeypatch, capsys)
    assert code == 0
    assert "server:" in out and "client:" in out and "activations" in out and "(fits)" in out
    monkeypatch.setattr(devices, "memory_available", lambda device: 2**20)  # 1 MiB free
    code, out, err = run_cli(["plan", str(path)], monkeypatch, capsys)
    assert code == 0 and "DOES NOT FIT" in out
    assert "exceeds the 1 MiB available" in caplog.text  # a warning, not a refusal
    code, _, err = run_cli(["plan", str(path), "--strict"], monkeypatch, capsys)
    # One error line (the partitioner's progress bars are stderr's only other lines).
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 2 and errors == [err.strip().splitlines()[-1]]
    assert errors[0].startswith("error: config error: device: the estimated peak")
    assert not (tmp_path / "runs").exists()


def test_run_prints_the_plans_line_first(tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(make_config(PLAN, tmp_path / "runs")))
    code, out, err = run_cli(["run", str(path), "-q"], monkeypatch, capsys)
    assert code == 0, err
    first = out.strip().splitlines()[0]
    assert first.startswith("plan: cpu, server and 6 clients in one process: peak ~")
    rows = (tmp_path / "runs" / "p" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["round"] == 1


def test_autocast_counts_only_where_the_cpu_has_bfloat16_instructions(
    tmp_path, monkeypatch
) -> None:
    cfg = make_config(PLAN, tmp_path)
    cfg["task"]["autocast_bf16"] = True
    parts = {}
    for native in (True, False):
        monkeypatch.setattr(devices, "cpu_bf16_native", lambda native=native: native)
        parts[native] = make_plan(load_config(cfg)).client.parts
    assert parts[True]["autocast copies"] > 0 and not parts[False].get("autocast copies")
    assert parts[False]["activations"] > parts[True]["activations"]  # float32: 4 bytes, not 2


def test_a_tabular_plan_counts_its_model_and_equals_the_audit_ledger(tmp_path) -> None:
    """The MLP's builder moves it to the run's device, which fails on ``meta``: the plan
    builds it on the CPU instead of printing 0.00 MB of traffic."""
    over = [f"out_dir={tmp_path}", "rounds=2", "partition.num_clients=3", "eval_before=false"]
    over += ["clients.min_clients=2", "algo.personal_eval=false", "plots=false"]
    cfg = load_config("tabular-fedavg", over)
    plan = make_plan(cfg)
    assert plan.client.trainable == sum(
        p.numel() for p in build(cfg).task.build_model().parameters()
    )
    assert plan.up == plan.down == plan.client.trainable * 4 and "0.00 MB" not in plan.summary()
    summary = run(cfg, progress=False)
    assert summary["bytes_up_arrays"] == cfg.rounds * plan.sampled * plan.up
    assert summary["bytes_down_arrays"] == cfg.rounds * plan.sampled * plan.down
    # The preset evaluates on every client: the plan says what that adds.
    notes = make_plan(load_config("tabular-fedavg", [f"out_dir={tmp_path}"])).notes
    assert (
        "personal evaluation sends each client the model once more per evaluation"
        f" ({plan.down:,} B down, not in the traffic per round)"
    ) in notes


def test_a_model_that_cannot_be_built_is_not_estimated_rather_than_zero(tmp_path, monkeypatch):
    from fedfm.tasks.supervised import SupervisedTask

    def broken(self: Any, seed: int = 0, **kw: Any) -> Any:
        raise OSError("weights not found")

    monkeypatch.setattr(SupervisedTask, "build_model", broken)
    plan = make_plan(load_config("tabular-fedavg", [f"out_dir={tmp_path}"]))
    assert plan.up is None and "traffic not estimated" in plan.summary()
    assert "0.00 MB" not in plan.summary() and "not estimated" in plan.table()
