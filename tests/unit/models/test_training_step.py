"""The training step's two savings change no number: the head on scored positions only
(:mod:`fedfm.models.lm_loss`) and frozen linear weights cast once (:mod:`fedfm.models.cast_once`).
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from torch import nn

from fedfm.models import lm_loss
from fedfm.models.cast_once import CAST_ATTR, cast_frozen_linears, release_file_weights
from fedfm.models.causal_lm import tiny_causal_lm
from fedfm.models.gated_mlp import fuse_gated_mlps
from fedfm.models.lm_loss import response_loss


def _lora(arch: str, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> peft.PeftModel:
    torch.manual_seed(0)
    base = tiny_causal_lm(arch, layers=2).model  # type: ignore[arg-type]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))
    return peft.get_peft_model(base, cfg)


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        ("llama", ("q_proj", "v_proj")),
        ("qwen2", ("q_proj", "v_proj")),
        ("gemma", ("q_proj", "v_proj")),
        ("llama", ("q_proj", "lm_head")),  # a head that trains gets its gradient too
    ],
)
def test_the_head_on_scored_positions_gives_the_models_own_loss_and_gradients(
    arch: str, targets: tuple[str, ...]
) -> None:
    model = _lora(arch, targets)
    batch = _batch(model.config.vocab_size)
    ours, out = response_loss(model, batch)
    assert out.logits is None  # the fast path ran
    theirs = model(**batch).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    g_ours, g_theirs = _grads(model, ours), _grads(model, model(**batch).loss)
    assert set(g_ours) == set(g_theirs) and g_ours
    assert all(any(t in name for name in g_ours) for t in targets)
    for name in g_ours:
        torch.testing.assert_close(g_ours[name], g_theirs[name], rtol=1e-5, atol=1e-7)


def _step_with(
    monkeypatch: pytest.MonkeyPatch, setting: str, value: int, model: nn.Module, batch: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A bfloat16 step's loss and gradients with ``lm_loss.<setting>`` set to ``value``."""
    monkeypatch.setattr(lm_loss, setting, value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = response_loss(model, batch)
    return loss.detach(), _grads(model, loss)


def test_the_heads_padding_rows_change_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lora("llama")
    batch = _batch(model.config.vocab_size)
    step = functools.partial(_step_with, monkeypatch, "ROWS", model=model, batch=batch)
    (padded, g_padded), (exact, g_exact) = step(32), step(1)  # 18 scored rows: 14 of padding
    assert int((batch["labels"][:, 1:] != -100).sum()) % 32 != 0
    assert torch.equal(padded, exact)
    assert all(torch.equal(g_padded[n], g_exact[n]) for n in g_exact)


def test_the_head_in_chunks_changes_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lora("llama")
    batch = _batch(model.config.vocab_size)
    step = functools.partial(_step_with, monkeypatch, "CHUNK", model=model, batch=batch)
    (chunked, g_chunked), (whole, g_whole) = step(5), step(10**6)  # 18 rows: 4 chunks, 1
    assert torch.equal(chunked, whole)
    assert all(torch.equal(g_chunked[n], g_whole[n]) for n in g_whole) and g_whole
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scored, _ = response_loss(model, batch)  # evaluation: no gradient taken
    assert torch.equal(scored, whole)


def test_a_scaled_loss_scales_the_chunked_heads_gradients() -> None:
    model = _lora("llama")
    batch = _batch(model.config.vocab_size)
    g_one = _grads(model, response_loss(model, batch)[0])
    g_half = _grads(model, response_loss(model, batch)[0] * 0.5)
    for name in g_one:
        torch.testing.assert_close(g_half[name], g_one[name] * 0.5, rtol=1e-6, atol=1e-9)


def test_no_logits_are_kept_for_the_backward_pass() -> None:
    model = _lora("llama")
    vocab = model.config.vocab_size
    batch = _batch(vocab)
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = response_loss(model, batch)
    alive = [r() for r in saved]
    wide = [t for t in alive if t is not None and t.dim() == 2 and t.shape[-1] == vocab]
    assert not wide  # the unchunked loss keeps its [N, V] log-softmax until the backward
    assert any(t is not None and t.shape[-1] == model.config.hidden_size for t in alive)
    loss.backward()


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_gated_mlp_keeping_two_activations_changes_no_number(arch: str, autocast: bool) -> None:
    plain = _lora(arch)
    fused = copy.deepcopy(plain)
    assert fuse_gated_mlps(fused) == 2 and fuse_gated_mlps(fused) == 0  # once per layer
    batch = _batch(plain.config.vocab_size)

    def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = response_loss(model, batch)
        return loss.detach(), _grads(model, loss)

    (a, g_a), (b, g_b) = step(plain), step(fused)
    assert torch.equal(a, b)
    assert set(g_a) == set(g_b) and all(torch.equal(g_a[n], g_b[n]) for n in g_a)


def test_the_fused_mlp_keeps_no_activation_of_the_gate() -> None:
    fused = _lora("llama")
    fuse_gated_mlps(fused)
    ids = torch.randint(0, fused.config.vocab_size, (2, 8))
    kept: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused(input_ids=ids).logits.sum()
    out.backward()
    wide = [s for s in kept if s == (2, 8, fused.config.intermediate_size)]
    assert len(wide) == 2 * 2  # gate(x) and up(x) per layer: the activation is recomputed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_label_scores_equal_the_full_logits_log_softmax_and_argmax(arch: str) -> None:
    model = _lora(arch)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"].clone()
        top = logits[:, :-1].argmax(-1)
        labels[:, 1:][:, ::2] = torch.where(labels[:, 1:][:, ::2] == -100, -100, top[:, ::2])
        batch["labels"] = labels  # every other label is the model's own top-1: hits to find
        got = lm_loss.label_scores(model, batch)
    assert got is not None
    targets = labels[:, 1:]
    keep = targets != -100
    full = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets.clamp_min(0)[..., None])
    assert torch.equal(got[0], torch.where(keep, full[..., 0], 0.0))
    assert torch.equal(got[1], (top == targets) & keep) and got[1].any() and not got[1].all()
    base: Any = model.get_base_model()
    base.config.model_type = "unknown"
    assert lm_loss.label_scores(model, batch) is None  # the caller takes the full logits


def test_a_model_without_a_plain_head_gets_its_own_forward() -> None:
    model = _lora("llama")
    base: Any = model.get_base_model()
    base.config.model_type = "unknown"
    loss, out = response_loss(model, _batch(model.config.vocab_size))
    assert out.logits is not None and torch.isfinite(loss)


def _train_steps(model: peft.PeftModel, batch: dict[str, torch.Tensor]) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = response_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_frozen_weights_cast_once_train_to_the_bit_as_autocast_casting_each_step() -> None:
    plain = _lora("llama")
    cast = copy.deepcopy(plain)
    made = cast_frozen_linears(cast, torch.bfloat16)
    frozen = [m for m in cast.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    assert made > 0 and all(hasattr(m, CAST_ATTR) for m in frozen)
    batch = _batch(plain.config.vocab_size)
    assert _train_steps(cast, batch) == _train_steps(plain, batch)
    for (n, a), (_, b) in zip(plain.named_parameters(), cast.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert cast_frozen_linears(cast, torch.bfloat16) == 0  # nothing missing or stale


def test_a_cast_copy_is_unused_outside_autocast_and_once_its_weight_changed() -> None:
    lin = nn.Linear(8, 4).requires_grad_(False)
    cast_frozen_linears(lin, torch.bfloat16)
    x = torch.randn(2, 8)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))  # float32
    with torch.no_grad():
        lin.weight.add_(1.0)  # the copy is now stale
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lin(x)
        want = nn.functional.linear(x, lin.weight, lin.bias)
    assert torch.equal(got, want)
    assert cast_frozen_linears(lin, torch.bfloat16) > 0  # recast


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    kib, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) == 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            kib += int(head[1])
    return kib


def _mapped_linear(path: Path, values: torch.Tensor, out_f: int, in_f: int) -> nn.Linear:
    """A frozen linear layer whose weight is a private mapping of ``values`` written to ``path``."""
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel())  # MAP_PRIVATE
    lin = nn.Linear(in_f, out_f).requires_grad_(False)
    lin.weight = nn.Parameter(mapped.view(out_f, in_f), requires_grad=False)
    return lin


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/maps are Linux's")
def test_file_mapped_float32_weights_are_dropped_after_the_cast_and_read_back_equal(
    tmp_path: Path,
) -> None:
    out_f, in_f = 256, 1024  # 1 MiB of float32: whole pages inside the weight
    values = torch.randn(out_f * in_f, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "weight.bin"
    lin = _mapped_linear(path, values, out_f, in_f)
    x = torch.randn(3, in_f)
    want_fp32 = lin(x)  # reads every page of the file
    before = _resident_kib(path)
    cast_frozen_linears(lin, torch.bfloat16)
    assert release_file_weights(lin) >= (1 << 20) - 2 * 4096  # all but the partial end pages
    assert _resident_kib(path) <= 8 < before  # the partial pages at both ends stay
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lin(x)
        want = nn.functional.linear(x, values.view(out_f, in_f), lin.bias)
    assert torch.equal(got, want)  # the copy serves autocast
    assert _resident_kib(path) <= 8  # without reading the float32 pages
    assert torch.equal(lin(x), want_fp32)  # a float32 read maps the file's pages again
    assert _resident_kib(path) >= before - 8


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/maps are Linux's")
def test_a_mapped_weight_changed_in_place_is_not_dropped(tmp_path: Path) -> None:
    values = torch.randn(256 * 1024, generator=torch.Generator().manual_seed(0))
    lin = _mapped_linear(tmp_path / "weight.bin", values, 256, 1024)
    with torch.no_grad():
        lin.weight[100:200] += 1.0  # private copies of these pages, unlike the file
    changed = lin.weight.clone()
    cast_frozen_linears(lin, torch.bfloat16)
    assert release_file_weights(lin) == 0
    assert torch.equal(lin.weight, changed)


def test_weights_in_anonymous_memory_are_not_dropped() -> None:
    lin = nn.Linear(1024, 256).requires_grad_(False)
    cast_frozen_linears(lin, torch.bfloat16)
    assert release_file_weights(lin) == 0
