"""Computing on the run's device: ``device: cpu`` and ``auto`` give the same runs here, and each
boundary moves what it is handed to where the model is (inputs) or back to the CPU (what leaves
a client).

No test needs a GPU: a boundary is shown to move tensors by making the model's device look like
another device (torch's ``meta`` device, or a patched ``model_device``), never by training a
model on ``meta``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from fedfm import devices, fm
from fedfm.config import TrainConfig, load_config
from fedfm.core import train as train_mod
from fedfm.core.dp import CPUNoiseDPOptimizer
from fedfm.engine import resolve
from fedfm.fm import bases as fm_bases
from fedfm.models import encoders
from fedfm.runtime import run
from fedfm.runtime.flower import client as flower_client
from fedfm.runtime.flower import deploy_client
from fedfm.runtime.flower.options import load_options
from fedfm.runtime.flower.payload import Payload
from fedfm.runtime.flower.simulation import backend_config, client_payload
from fedfm.tasks import supervised
from fedfm.tasks.base import TASKS, Task
from helpers.cli import run_cli

META = torch.device("meta")
TINY = {"vocab": "small", "hidden": 16, "layers": 1, "heads": 2, "seed": 0}


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _same_runs(tmp_path: Path, cfg: dict[str, Any]) -> None:
    """Runs ``cfg`` with ``device: cpu`` and ``device: auto``; metrics must be bit-identical."""
    out = {}
    for device in ("cpu", "auto"):
        c = {**cfg, "name": f"d-{device}", "device": device, "out_dir": str(tmp_path)}
        summary = run(load_config(c), progress=False)
        rows = _rows(tmp_path / c["name"])
        timeless = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]
        out[device] = (summary["final"], timeless)
        assert summary["compute"]["device"] == "cpu"
    assert out["cpu"] == out["auto"]


@pytest.mark.parametrize("native", [True, False])
def test_the_summary_records_the_precision_the_run_computed_in(monkeypatch, native) -> None:
    """``autocast_bf16: true`` is bfloat16 only where the CPU has it; a task without the
    option (tabular) and one that turns it off compute in the model's dtype."""
    from fedfm.engine import _compute

    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: native)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cfg = load_config({"device": "cpu"})
    on, off = (SimpleNamespace(cfg=SimpleNamespace(autocast_bf16=b)) for b in (True, False))
    dtype = "bfloat16" if native else None
    assert _compute(cfg, on) == {"device": "cpu", "autocast": dtype, "allocator": "system"}
    # The C allocator too: memory, not numbers, but a run folder read elsewhere says which.
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert _compute(cfg, on)["allocator"] == "jemalloc"
    assert _compute(cfg, off)["autocast"] is None
    assert _compute(cfg, SimpleNamespace(cfg=SimpleNamespace()))["autocast"] is None


# ----------------------------------------------------------------------------- whole runs


def test_cpu_and_auto_give_bit_identical_fedit_runs(tmp_path, monkeypatch) -> None:
    _no_cuda(monkeypatch)  # auto is the CPU, whatever this machine has
    task = {
        "kind": "instruction",
        "model": "tiny-llama",
        "model_args": TINY,
        "source_options": {"per_domain_train": 2, "per_domain_test": 1},
    }
    cfg = {"rounds": 1, "task": task, "train": {"steps": 2, "batch_size": 2}, "plots": False}
    _same_runs(tmp_path, cfg)


def test_cpu_and_auto_give_bit_identical_supervised_runs(tmp_path, monkeypatch) -> None:
    _no_cuda(monkeypatch)
    cfg = {
        "rounds": 2,
        "algorithm": "fedprox",
        "task": {"kind": "tabular", "dataset": "breast_cancer", "model": "mlp"},
        "partition": {"scheme": "iid", "num_clients": 3},
        "train": {"steps": 3, "batch_size": 16, "prox_mu": 0.1},
        "plots": False,
    }
    _same_runs(tmp_path, cfg)


# ----------------------------------------------------------------------------- helpers


def test_to_device_moves_every_tensor_and_leaves_the_rest() -> None:
    ids = torch.arange(6).view(2, 3)
    batch = {"input_ids": ids, "pair": (ids, ["a text"]), "n": 3}
    moved = devices.to_device(batch, META)
    assert moved["input_ids"].device == META and moved["pair"][0].device == META
    assert moved["pair"][1] == ["a text"] and moved["n"] == 3
    assert isinstance(moved["pair"], tuple)
    assert devices.to_device(ids, torch.device("cpu")) is ids  # already there: no copy


def test_model_device_is_where_the_parameters_are() -> None:
    assert devices.model_device(nn.Linear(2, 2, device=META)) == META
    assert devices.model_device(nn.ReLU()) == torch.device("cpu")


def test_autocast_is_bfloat16_where_native_else_float16_but_never_float16_for_dp(
    monkeypatch,
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: True)
    with devices.autocast(cpu):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert isinstance(devices.autocast(cpu, enabled=False), contextlib.nullcontext)
    assert devices.grad_scaler(cpu) is None
    _half(monkeypatch)  # a pre-Ampere GPU's float16, taken on the CPU
    with devices.autocast(cpu):
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert isinstance(devices.autocast(cpu, half=False), contextlib.nullcontext)
    scaler = devices.grad_scaler(cpu)
    assert scaler is not None and scaler.get_scale() == 2.0**12


def test_a_cpu_without_bfloat16_instructions_gets_no_autocast(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: False)
    assert not devices.supports_bf16(cpu) and devices.autocast_dtype(cpu) is None
    assert isinstance(devices.autocast(cpu), contextlib.nullcontext)
    assert devices.grad_scaler(cpu) is None and not devices.needs_grad_scaler(cpu)
    # A GPU keeps float16 where it lacks bfloat16.
    monkeypatch.setattr(devices, "supports_bf16", lambda d: False)
    assert devices.autocast_dtype(torch.device("cuda")) == torch.float16


def _half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast and the scaler as on a GPU without bfloat16, taken on the CPU."""
    monkeypatch.setattr(devices, "autocast_dtype", lambda d: torch.float16)


def _fit_line(steps: int, scale: float = 1.0) -> tuple[nn.Linear, train_mod.TrainResult]:
    """A seeded linear model fitted by :func:`local_train` under the device's autocast."""
    torch.manual_seed(0)
    model, x = nn.Linear(8, 1), torch.randn(32, 8)
    y = x @ torch.linspace(-1, 1, 8)[:, None]

    def loss_fn(m: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        with devices.autocast(torch.device("cpu")):
            out = m(batch)
        return scale * ((out.float() - y) ** 2).mean(), out

    cfg = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0)
    return model, train_mod.local_train(model, iter([x] * steps), loss_fn, cfg, steps)


def test_local_training_under_float16_scales_its_gradients_and_skips_overflows(
    monkeypatch,
) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_native", lambda: True)
    reference, ref = _fit_line(20)  # bfloat16 autocast, no scaler
    _half(monkeypatch)
    half, res = _fit_line(20)
    assert res.skipped == 0 and ref.skipped == 0
    assert res.loss < 0.5 * _fit_line(1)[1].loss  # it trained
    assert torch.allclose(half.weight, reference.weight, atol=2e-2)
    # A loss whose scaled gradients overflow float16: the scaler skips those steps.
    start, _ = _fit_line(0)
    blown, res = _fit_line(3, scale=1e4)
    assert res.skipped == 3 and torch.equal(blown.weight, start.weight)


# ----------------------------------------------------------------------------- boundaries


class _Seen(Exception):
    """Stops a training loop once its loss function has seen a batch."""


def test_local_train_hands_batches_on_the_model_device(monkeypatch) -> None:
    seen: list[torch.device] = []

    def loss_fn(m: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        x, y = batch
        seen.extend([x.device, y.device])
        raise _Seen

    monkeypatch.setattr(train_mod, "model_device", lambda m: META)
    batches = iter([(torch.zeros(2, 3), torch.zeros(2))])
    cfg = TrainConfig(steps=1, batch_size=2, optimizer="sgd", lr=0.1)
    with pytest.raises(_Seen):
        train_mod.local_train(nn.Linear(3, 1), batches, loss_fn, cfg, 1)
    assert seen == [META, META]


def test_get_params_hands_back_cpu_copies() -> None:
    model = nn.Linear(2, 2)
    params = train_mod.get_params(model)
    assert {t.device for t in params.values()} == {torch.device("cpu")}
    assert params["weight"].data_ptr() != model.weight.data_ptr()


def _tabular_task() -> Task:
    cfg = load_config({"task": {"kind": "tabular", "dataset": "breast_cancer"}})
    _, task_cfg = resolve(cfg)
    return TASKS.get(task_cfg.kind)(task_cfg, cfg)


class _Recorder(nn.Module):
    """Records the device of its inputs; answers zeros on the CPU."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.out, self.seen, self.answer_on = out, set(), torch.device("cpu")
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add(x.device)
        return torch.zeros(x.shape[0], self.out, device=self.answer_on)


def test_supervised_task_builds_on_its_device_and_moves_inputs(monkeypatch) -> None:
    task = _tabular_task()
    assert task.device == torch.device("cpu")
    monkeypatch.setattr(Task, "device", property(lambda self: META))
    assert {p.device for p in task.build_model(seed=0).parameters()} == {META}
    monkeypatch.setattr(supervised, "model_device", lambda m: META)
    model = _Recorder(task.num_classes)
    out = task.predict(model, task.test_data())
    assert model.seen == {META} and out.device == torch.device("cpu")  # metrics on the CPU
    model.seen.clear()
    model.answer_on = META  # the loss pairs the outputs with labels moved to the same device
    loss, _ = task.loss(model, next(task.batches(task.client_data("0"), 4, seed=0)))
    assert model.seen == {META} and loss.device == META


def test_dp_noise_is_opacus_own_cpu_draw_and_follows_the_gradient(monkeypatch) -> None:
    def step(cls: type[DPOptimizer], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        p = nn.Parameter(torch.zeros(5, device=device))
        gen = torch.Generator().manual_seed(3)
        opt = cls(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                  expected_batch_size=1, generator=gen)  # fmt: skip
        p.summed_grad = torch.ones(5, device=device)
        opt.add_noise()
        return p.grad, gen.get_state()

    ours, ours_state = step(CPUNoiseDPOptimizer, torch.device("cpu"))
    theirs, theirs_state = step(DPOptimizer, torch.device("cpu"))
    assert torch.equal(ours, theirs) and torch.equal(ours_state, theirs_state)
    # A gradient elsewhere gets noise from the CPU generator (it advances by the same draw).
    grad, state = step(CPUNoiseDPOptimizer, META)
    assert grad.device == META and torch.equal(state, ours_state)


def test_the_llm_base_is_shared_per_device(monkeypatch) -> None:
    cpu = fm.base_key("tiny-llama", "float32", TINY)
    assert fm.base_key("tiny-llama", "float32", TINY, device=torch.device("cpu")) == cpu
    assert fm.base_key("tiny-llama", "float32", TINY, device=torch.device("cuda:1")) != cpu
    handle = fm.FoundationModel("tiny-llama", args=TINY, device=META)
    try:
        assert handle.key != cpu and handle.device == META
        assert {p.device for p in handle.bundle.model.parameters()} == {META}
        assert isinstance(handle.autocast(), contextlib.nullcontext)  # no bf16 on meta
    finally:
        fm_bases.forget(handle.key)


def test_encoders_are_built_per_device() -> None:
    built: list[nn.Module] = []

    def builder() -> encoders.Encoder:
        built.append(nn.Linear(2, 3))
        return encoders.Encoder("test-per-device", 3, built[-1], built[-1])

    if "test-per-device" not in encoders.ENCODERS:
        encoders.register_encoder("test-per-device", "images")(builder)
    encoders.clear_encoders()
    try:
        meta = encoders.load_encoder("test-per-device", "meta")
        assert encoders.load_encoder("test-per-device", torch.device("meta")) is meta
        cpu = encoders.load_encoder("test-per-device")
        assert encoders.load_encoder("test-per-device", "cpu") is cpu  # no device: the CPU
    finally:
        encoders.clear_encoders()
    assert len(built) == 2  # once per device
    assert {p.device.type for p in built[0].parameters()} == {"meta"}
    assert {p.device.type for p in built[1].parameters()} == {"cpu"}
    assert not any(p.requires_grad for m in built for p in m.parameters())


# ----------------------------------------------------------------------------- Flower


def test_simulated_clients_ask_for_a_gpu_share_only_on_cuda_runs() -> None:
    opts = load_options({})
    assert backend_config(opts, cuda=False)["client_resources"]["num_gpus"] == 0.0
    assert backend_config(opts, cuda=True)["client_resources"]["num_gpus"] == 1.0
    quarter = load_options({"client_gpus": 0.25})
    assert backend_config(quarter, cuda=True)["client_resources"]["num_gpus"] == 0.25
    payload = Payload(config={"device": "cuda:1", "seed": 0})
    assert client_payload(payload).config == {"device": "cuda", "seed": 0}
    assert payload.config["device"] == "cuda:1"  # the server's own payload is untouched


def test_a_client_node_computes_on_its_own_device(monkeypatch, capsys) -> None:
    cmd = deploy_client.supernode_command("h:1", 0, 2, 9, device="cuda:1")
    node_config = cmd[cmd.index("--node-config") + 1]
    assert node_config.endswith(' device="cuda:1"')
    assert "device" not in deploy_client.supernode_command("h:1", 0, 2, 9)[4]
    payload = Payload(config=load_config({"device": "auto"}).model_dump(mode="json"))
    assert payload.run_config("cpu").device == "cpu"
    assert payload.run_config().device == "auto"

    ctx = SimpleNamespace(node_config={"partition-id": 0, "device": "cpu"}, run_config={})
    built: list[Any] = []
    monkeypatch.setattr(flower_client, "runtime_for", lambda p, d=None: built.append(d))
    flower_client._runtime(ctx, payload)  # type: ignore[arg-type]
    assert built == ["cpu"]
    code, _, err = run_cli(
        ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "2",
         "--insecure", "--device", "tpu"],
        monkeypatch, capsys,
    )  # fmt: skip
    assert code == 2 and "device" in err and "tpu" in err and len(err.strip().splitlines()) == 1
