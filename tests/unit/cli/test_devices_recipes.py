"""The device setting, quantised bases and the recipe knobs: validation at load, the loader's
bitsandbytes arguments, the learning-rate schedule over rounds and its exact resume."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedfm import devices
from fedfm.config import TrainConfig, load_config
from fedfm.core import train as train_mod
from fedfm.core.train import round_config, scheduled_lr
from fedfm.engine import Engine
from fedfm.errors import ConfigError
from fedfm.models.causal_lm import quantization_kwargs
from fedfm.models.lora import LoraConfigSpec, auto_targets
from fedfm.runtime import run
from helpers import REPO
from helpers.cli import run_cli

TINY = {"vocab": "small", "hidden": 16, "layers": 1, "heads": 2, "seed": 0}


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _bnb(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    """bitsandbytes as installed (``present``) or not, whatever this machine has."""
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any, **kw: Any) -> Any:
        if name == "bitsandbytes":
            return real("json") if present else None  # any spec stands for "installed"
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _lm_yaml(tmp_path: Path, **task: Any) -> Path:
    cfg = {
        "name": "c",
        "rounds": 2,
        "task": {
            "kind": "instruction",
            "model": "tiny-llama",
            "model_args": TINY,
            "source_options": {"per_domain_train": 2, "per_domain_test": 1},
            **task,
        },
        "train": {"steps": 1, "batch_size": 2},
        "out_dir": str(tmp_path / "runs"),
        "plots": False,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ----------------------------------------------------------------------------- devices


def test_device_names_resolve_and_unknown_or_absent_devices_are_refused(monkeypatch) -> None:
    _no_cuda(monkeypatch)
    assert devices.resolve("auto") == torch.device("cpu")  # auto: CUDA only when present
    assert devices.resolve("cpu") == torch.device("cpu")
    for bad, why in [("gpu", "unknown device"), ("cuda:x", "unknown device"), ("cuda", "no CUDA")]:
        with pytest.raises(ValueError, match=why):
            devices.check(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.check("cuda:1") == "cuda:1"
    assert devices.resolve("auto") == torch.device("cuda")
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        devices.check("cuda:2")


def test_autocast_is_bf16_on_a_cpu_with_its_instructions_and_ram_is_what_fits(
    monkeypatch,
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: True)
    assert devices.supports_bf16(cpu) and devices.autocast_dtype(cpu) == torch.bfloat16
    assert not devices.needs_grad_scaler(cpu)
    assert devices.memory_available(cpu) > 0


@pytest.mark.parametrize(
    ("argv", "bnb", "line"),
    [
        (["device=cuda"], False, "error: config error: device: 'cuda' asked for, but torch"),
        (["device=gpu"], False, "error: config error: device: unknown device 'gpu'"),
        (["task.quantization=4bit"], False, "error: config error: task.quantization: needs the"),
        (["task.quantization=8bit"], True, "error: config error: task.quantization: bitsandbytes"),
        (["task.quantization=2bit"], True, "error: config error: task.quantization: input should"),
        (["train.optimizer=adamw_8bit"], False, "error: config error: train.optimizer: adamw_8bit"),
        (["train.optimizer=paged_adamw_8bit"], True, "error: config error: train.optimizer: paged"),
        (["task.lora.target_modules=qv"], False, "error: config error: task.lora.target_modules:"),
        (
            ["train.schedule.name=cosine", "train.schedule.min_lr=1"],
            False,
            "error: config error: train.schedule.min_lr: 1 is above train.lr",
        ),
        (["train.schedule.warmup_rounds=2"], False, "error: config error: train.schedule.warmup"),
    ],
)
def test_refusals_are_one_line_exit_2_and_write_nothing(
    tmp_path, monkeypatch, capsys, argv, bnb, line
) -> None:
    _no_cuda(monkeypatch)
    _bnb(monkeypatch, bnb)
    code, _, err = run_cli(["run", str(_lm_yaml(tmp_path)), *argv], monkeypatch, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert not (tmp_path / "runs").exists()


def test_auto_targets_come_from_peft_and_an_unknown_architecture_names_the_field(
    tmp_path, monkeypatch, capsys
) -> None:
    from transformers import MambaConfig

    assert auto_targets("llama") == auto_targets("qwen2") == ["q_proj", "v_proj"]
    assert LoraConfigSpec(target_modules="all-linear").targets("gemma") == "all-linear"
    folder = tmp_path / "mamba"
    MambaConfig(hidden_size=8, num_hidden_layers=1).save_pretrained(folder)
    task = {"model": "causal-lm", "model_args": {"name_or_path": str(folder)}}
    path = _lm_yaml(tmp_path, lora={"target_modules": "auto"}, **task)
    code, _, err = run_cli(["run", str(path)], monkeypatch, capsys)
    assert code == 2 and not (tmp_path / "runs").exists()
    assert err.strip() == (
        "error: config error: task.lora.target_modules: 'auto' knows no LoRA targets for"
        " architecture 'mamba'; list the linear layers to adapt (e.g. [q_proj, v_proj]) or use"
        " all-linear"
    )


def test_quantised_loader_arguments_follow_qlora() -> None:
    four = quantization_kwargs("4bit", torch.bfloat16, "cuda:1")
    q = four["quantization_config"]
    assert q.load_in_4bit and not q.load_in_8bit
    assert q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    assert four["device_map"] == {"": "cuda:1"}
    eight = quantization_kwargs("8bit", torch.float16)
    assert eight["quantization_config"].load_in_8bit
    assert eight["device_map"] == {"": "cuda:0"}
    with pytest.raises(ConfigError, match=r"task\.quantization: needs a CUDA device"):
        quantization_kwargs("4bit", torch.bfloat16, "cpu")


def test_recipe_options_are_listed(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(["list"], monkeypatch, capsys)
    assert code == 0
    for key in ("device=", "train.schedule.name=", "task.lora.use_dora=", "task.quantization="):
        assert key in out
    assert "paged_adamw_8bit" in out and "all-linear" in out


# ----------------------------------------------------------------------------- lr schedule


def test_cosine_annealing_and_warm_up_by_hand() -> None:
    cfg = TrainConfig(lr=1e-3, schedule={"name": "cosine", "min_lr": 1e-5})
    for t in range(1, 6):  # FlowerTune's cosine_annealing(t, 5, 1e-3, 1e-5)
        want = 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * t / 5))
        assert scheduled_lr(cfg, t, 5) == pytest.approx(want, rel=1e-12)
    assert scheduled_lr(cfg, 5, 5) == pytest.approx(1e-5)
    assert scheduled_lr(cfg, 0, 5) == scheduled_lr(cfg, 1, 5)  # the phase before the rounds
    warm = TrainConfig(lr=1e-3, schedule={"name": "cosine", "min_lr": 0.0, "warmup_rounds": 2})
    assert [scheduled_lr(warm, t, 6) for t in (1, 2)] == [5e-4, 1e-3]
    assert scheduled_lr(warm, 4, 6) == pytest.approx(0.5e-3)  # halfway through rounds 3..6
    assert scheduled_lr(warm, 6, 6) == pytest.approx(0.0, abs=1e-18)
    flat = TrainConfig(lr=0.1, schedule={"warmup_rounds": 4})
    assert [scheduled_lr(flat, t, 8) for t in (1, 4, 8)] == [0.025, 0.1, 0.1]
    plain = TrainConfig(lr=0.1)
    assert round_config(plain, 3, 10) is plain  # constant: the config itself, untouched


def _toy(out: Path, name: str, rounds: int = 3) -> dict[str, Any]:
    return {
        "name": name,
        "algorithm": "scaffold",
        "rounds": rounds,
        "seed": 2,
        "task": {"kind": "toy", "num_clients": 3},
        "train": {
            "steps": 4,
            "batch_size": 8,
            "lr": 0.2,
            "schedule": {"name": "cosine", "min_lr": 0.01, "warmup_rounds": 1},
        },
        "out_dir": str(out),
        "plots": False,
    }


def test_clients_train_at_the_rounds_rate_and_resume_is_exact(tmp_path, monkeypatch) -> None:
    from helpers import toy  # noqa: F401  (registers the toy task)

    seen: list[float] = []
    make = train_mod.make_optimizer

    def recording(params: Any, cfg: TrainConfig) -> Any:
        seen.append(cfg.lr)
        return make(params, cfg)

    monkeypatch.setattr(train_mod, "make_optimizer", recording)
    cfg = load_config(_toy(tmp_path, "straight"))
    run(cfg, progress=False)
    want = [scheduled_lr(cfg.train, t, 3) for t in (1, 2, 3)]
    assert want[0] == 0.2 and want[2] == pytest.approx(0.01)
    assert seen == [lr for lr in want for _ in range(3)]

    step = Engine._step

    def stop_after_two(self: Engine, rnd: int, *a: Any, **kw: Any) -> None:
        if rnd == 3:
            raise KeyboardInterrupt
        step(self, rnd, *a, **kw)

    monkeypatch.setattr(Engine, "_step", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(load_config(_toy(tmp_path, "resumed")), progress=False)
    monkeypatch.setattr(Engine, "_step", step)
    run(load_config(_toy(tmp_path, "resumed")), resume=True, progress=False)

    def rows(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in lines]

    assert rows("resumed") == rows("straight")


def test_gpu_check_says_there_is_no_cuda_and_exits_0() -> None:
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check itself is what runs there")
    script = REPO / "benchmarks" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        "no CUDA device: torch sees none on this machine, so there is nothing to compare"
    )
