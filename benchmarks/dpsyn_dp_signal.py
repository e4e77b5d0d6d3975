"""Can dpsyn's strong clients learn under DP-SGD? Signal against noise, then short real runs.

``grads``: per-example gradients of FFA-LoRA's ``B`` (rank 8, q/k/v/o of every layer, at
initialisation) on one strong client's rows of the dpsyn study (``fedfm reproduce dpsyn``).
At ``B = 0`` the gradient of a rank-``r`` ``B`` is ``s·G·Aᵀ`` column by column, so the first
``r`` columns of rank 8's are rank ``r``'s (same scale ``α/r``); a subset of modules or layers
is a subset of coordinates. For each candidate (rank, modules, layers, expected batch ``B``,
steps ``T``) it prints the coordinates ``d``, the per-example gradient norms, the clipped
mean's norm (``‖E clip(g)‖``, unbiased over the examples), the noise per step
``σ·C/B·√d`` with ``σ`` from the study's planner (ε, δ, ``q = B/n``, ``T``), and the ratio of
signal to noise after ``T`` steps, ``√T · ‖E clip(g)‖ / (σ·C·√d / B)`` (a constant gradient:
the signal adds up linearly, the noise as ``√T``).

``train``: one round of ``T`` DP-SGD steps (fedfm's own ``FoundationModel.dp_train``, noise
from the planner) on each of ``k`` strong clients from the same start; the 1-strong update
is one client's, the k-strong update their mean (dpsyn's equal-weight FedAvg after round 1),
and the held-out reference NLL (response tokens of real test reviews, the study's prompt) of
the base, each single client and the mean, paired over test rows.

Run with ``PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 15 python benchmarks/dpsyn_dp_signal.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.core.batching import collate
from fedfm.core.dp import DPSGDConfig, calibrate_noise, per_sample_loss, sample_rate
from fedfm.core.settings import TrainConfig
from fedfm.core.state import ClientState
from fedfm.fm.training import Adapters
from fedfm.models.generation import pad_id_of
from fedfm.reproduce.dpsyn import Grid, generator_config, voters
from fedfm.reproduce.framework import merge, task_of

ADAPTER = "probe"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def build(lora: dict[str, Any]) -> tuple[Any, Any, Grid]:
    """The study's task (its data, prompt and LM) with ``lora`` as ``task.lora``."""
    grid = Grid()
    cfg = generator_config(grid, grid.many)
    cfg["task"] = merge(cfg["task"], {"lora": lora})
    task = task_of(cfg)
    return task, task.foundation_model(), grid


def strong_ids(grid: Grid) -> list[str]:
    """The strong clients of the study's most-strong federation."""
    weak = set(voters(grid, grid.many))
    return [str(i) for i in range(grid.clients) if str(i) not in weak]


def encoded(task: Any, fm: Any, grid: Grid, data: Any) -> list[dict[str, list[int]]]:
    """The "code → text" rows of ``data`` as dpsyn's client encodes them."""
    codes = task.codes()
    ids = task.code_ids(data).tolist()
    texts = task.texts(data)
    return fm.encode(
        {"instruction": grid.prompt_template.format(code=codes[j]), "output": t}
        for j, t in zip(ids, texts, strict=True)
    )


def grads(args: argparse.Namespace) -> None:
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "freeze_a": True, "target_modules": list(MODULES)}
    task, fm, grid = build(lora)
    cid = strong_ids(grid)[0]
    rows = encoded(task, fm, grid, task.client_data(cid))[: args.examples]
    fm.add_adapter(ADAPTER, seed=0)
    names = fm.param_names(ADAPTER)
    t0 = time.process_time()
    out: dict[str, list[np.ndarray]] = {}
    with fm.use([ADAPTER], [ADAPTER]) as model:
        live = dict(model.named_parameters())
        for key, pname in names.items():
            live[pname].requires_grad_(key.endswith("lora_B.weight"))
        keys = [k for k in names if k.endswith("lora_B.weight")]
        pad = pad_id_of(fm.tokenizer)
        for row in rows:
            model.zero_grad(set_to_none=True)
            with fm.dp_autocast():
                loss = per_sample_loss(model, collate([row], pad)).mean()
            loss.backward()
            for k in keys:
                g = live[names[k]].grad
                assert g is not None
                out.setdefault(k, []).append(g.detach().float().numpy().copy())
    cpu = time.process_time() - t0
    arrays: dict[str, Any] = {k: np.stack(v) for k, v in out.items()}  # (n, out, 8)
    np.savez_compressed(args.out, **arrays)
    print(f"{len(rows)} examples of client {cid}, {len(keys)} B tensors, {cpu:.0f} CPU s")


def candidate(
    arrays: dict[str, np.ndarray], rank: int, modules: Sequence[str], layers: Sequence[int]
) -> np.ndarray:
    """Per-example gradients (n, d) of a candidate's ``B`` coordinates."""
    parts = []
    for k, v in sorted(arrays.items()):
        layer = int(k.split("layers.")[1].split(".")[0])
        if layer in layers and any(f".{m}." in k for m in modules):
            parts.append(v[:, :, :rank].reshape(len(v), -1))
    return np.concatenate(parts, axis=1)


def snr(args: argparse.Namespace) -> None:
    with np.load(args.grads) as z:
        arrays = {k: np.asarray(z[k], np.float64) for k in z.files}
    n_rows, delta, eps = 500, 1e-4, 8.0
    layers_all = list(range(30))
    cands: list[tuple[str, int, tuple[str, ...], list[int]]] = [
        ("r8 qkvo all 30 layers (B only)", 8, MODULES, layers_all),
        ("r2 qkvo all layers", 2, MODULES, layers_all),
        ("r1 qkvo all layers", 1, MODULES, layers_all),
        ("r1 q,v all layers", 1, ("q_proj", "v_proj"), layers_all),
        ("r1 v,o all layers", 1, ("v_proj", "o_proj"), layers_all),
        ("r1 o all layers", 1, ("o_proj",), layers_all),
        ("r1 v all layers", 1, ("v_proj",), layers_all),
        ("r2 v all layers", 2, ("v_proj",), layers_all),
        ("r1 v,o last 8 layers", 1, ("v_proj", "o_proj"), layers_all[-8:]),
        ("r1 v first 15 layers", 1, ("v_proj",), layers_all[:15]),
        ("r1 v first 8 layers", 1, ("v_proj",), layers_all[:8]),
        ("r1 q,v first 15 layers", 1, ("q_proj", "v_proj"), layers_all[:15]),
        ("r2 v first 15 layers", 2, ("v_proj",), layers_all[:15]),
    ]
    plans = [(32, 15), (64, 30), (128, 15), (128, 30), (256, 8), (32, 60)]
    print(
        "candidate | d | median ‖g_i‖ | C | ‖E clip g‖ | coherence | "
        + " | ".join(f"B{b} T{t}: σ, noise/step, SNR√T" for b, t in plans)
    )
    for label, r, mods, layers in cands:
        g = candidate(arrays, r, mods, layers)
        n, d = g.shape
        norms = np.linalg.norm(g, axis=1)
        c = float(np.median(norms))  # clipping at the median norm
        clipped = g * np.minimum(1.0, c / norms)[:, None]
        s = clipped.sum(0)
        sq = float((clipped**2).sum())
        signal = math.sqrt(max(0.0, (float(s @ s) - sq) / (n * (n - 1))))  # unbiased ‖E‖
        coh = signal / float(np.mean(np.minimum(norms, c)))
        cells = []
        for b, t in plans:
            q = sample_rate(b, n_rows)
            sigma = calibrate_noise(eps, delta, q, t)
            noise = sigma * c * math.sqrt(d) / b
            cells.append(f"{sigma:.2f}, {noise:.3g}, {math.sqrt(t) * signal / noise:.2f}")
        print(
            f"{label} | {d} | {np.median(norms):.3g} | {c:.3g} | {signal:.3g} | {coh:.3f} | "
            + " | ".join(cells)
        )


def probe(args: argparse.Namespace) -> None:
    """The clipped mean gradient of one batch, and the held-out-row NLL a step along it gives.

    ``B = −η · mean_i clip(g_i)`` for each ``η``, scored on other rows of the same client:
    how far plain gradient steps can move the loss, before any noise (it sizes the lr).
    """
    lora = json.loads(args.lora)
    task, fm, grid = build(lora)
    rows = encoded(task, fm, grid, task.client_data(strong_ids(grid)[0]))
    fit, held = rows[: args.examples], rows[args.examples : 2 * args.examples]
    fm.add_adapter(ADAPTER, seed=1)
    start = fm.get_adapter(ADAPTER)
    names = fm.param_names(ADAPTER)
    keys = [k for k in names if k.endswith("lora_B.weight")]
    pad = pad_id_of(fm.tokenizer)
    t0 = time.process_time()
    total = {k: torch.zeros_like(start[k]) for k in keys}
    norms = []
    with fm.use([ADAPTER], [ADAPTER]) as model:
        live = dict(model.named_parameters())
        for key, pname in names.items():
            live[pname].requires_grad_(key in keys)
        for row in fit:
            model.zero_grad(set_to_none=True)
            with fm.dp_autocast():
                loss = per_sample_loss(model, collate([row], pad)).mean()
            loss.backward()
            g = {k: live[names[k]].grad.detach().float().clone() for k in keys}
            n = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
            norms.append(n)
            for k in keys:
                total[k] += g[k] * min(1.0, args.clip / n)
        model.zero_grad(set_to_none=True)
    mean = {k: v / len(fit) for k, v in total.items()}
    print(
        f"d={sum(v.numel() for v in mean.values())} median ‖g_i‖ {np.median(norms):.3f}"
        f" ‖mean clip g‖ {math.sqrt(sum(float((v**2).sum()) for v in mean.values())):.4f}"
        f" ({time.process_time() - t0:.0f} CPU s)"
    )
    base = None
    for eta in (float(x) for x in args.steps.split(",")):
        state = {k: (start[k] - eta * mean[k]) if k in mean else start[k] for k in start}
        got = nll(fm, held, state)
        base = got if base is None else base
        print(
            f"η {eta:g}: held-out rows NLL {got.mean():.4f} (− η 0: {paired(got, base)})"
            f" [{time.process_time() - t0:.0f} CPU s]"
        )


def nll(
    fm: Any, rows: list[dict[str, list[int]]], adapter: dict[str, torch.Tensor] | None
) -> np.ndarray:
    """Each row's mean response-token NLL under the base plus ``adapter`` (None: the base)."""
    pad = pad_id_of(fm.tokenizer)
    out = []
    with torch.no_grad():
        if adapter is None:
            with fm.use([]) as model:
                for i in range(0, len(rows), 16):
                    with fm.autocast():
                        out.append(per_sample_loss(model, collate(rows[i : i + 16], pad)).float())
        else:
            with fm.slot(ADAPTER, adapter), fm.use([ADAPTER]) as model:
                for i in range(0, len(rows), 16):
                    with fm.autocast():
                        out.append(per_sample_loss(model, collate(rows[i : i + 16], pad)).float())
    return torch.cat(out).numpy().astype(np.float64)


def paired(a: np.ndarray, b: np.ndarray) -> str:
    d = a - b
    return f"{d.mean():+.4f} ± {d.std(ddof=1) / math.sqrt(len(d)):.4f}"


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    lora = json.loads(args.lora)
    task, fm, grid = build(lora)
    cids = strong_ids(grid)[: args.clients]
    test = encoded(task, fm, grid, task.test_data())
    rng = np.random.default_rng(0)
    test = [test[i] for i in sorted(rng.choice(len(test), args.test, replace=False))]
    fm.add_adapter(ADAPTER, seed=1)
    start = fm.get_adapter(ADAPTER)
    frozen = (
        frozenset(k for k in start if k.endswith("lora_A.weight"))
        if lora.get("freeze_a")
        else frozenset()
    )
    t_cfg = TrainConfig(
        steps=args.steps,
        batch_size=args.batch,
        optimizer=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
    )
    rate = sample_rate(args.batch, 500)
    sigma = calibrate_noise(args.epsilon, 1e-4, rate, args.planned or args.steps)
    if args.sigma is not None:  # a given σ (e.g. another plan's noise per averaged gradient)
        sigma = args.sigma
    dp = DPSGDConfig(
        epsilon=args.epsilon,
        max_grad_norm=args.clip,
        noise_multiplier=sigma,
        physical_batch_size=args.batch,
    )
    d = sum(v.numel() for k, v in start.items() if k not in frozen)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"d={d} σ={sigma:.3f} q={rate:.3f} clients={cids} load={load}")
    t0 = time.process_time()
    only = [int(x) for x in args.only.split(",")] if args.only else list(range(len(cids)))
    for i in only if not args.score else []:
        cid = cids[i]
        rows = encoded(task, fm, grid, task.client_data(cid))
        with fm.slot(ADAPTER, start):
            res, out = fm.dp_train(
                rows,
                ClientState(),
                Adapters([ADAPTER], [ADAPTER], frozen),
                train=t_cfg,
                dp=dp,
                delta=1e-4,
                steps=args.steps,
                planned_steps=args.planned or args.steps,
                seed=1000 + i,
            )
        u = {k: out[k] - start[k] for k in start if k not in frozen}
        torch.save(u, args.save / f"update-{i}.pt")
        norm = math.sqrt(sum(float((v.float() ** 2).sum()) for v in u.values()))
        print(
            f"client {cid}: loss {res.loss:.4f} ε {res.epsilon:.2f} update norm {norm:.4f}"
            f" ({time.process_time() - t0:.0f} CPU s)",
            flush=True,
        )
    if args.only and not args.score:
        return  # one process per group of clients; `--score` reads their updates
    updates = [torch.load(args.save / f"update-{i}.pt") for i in range(len(cids))]
    mean = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    norm_mean = math.sqrt(sum(float((v.float() ** 2).sum()) for v in mean.values()))
    singles = [math.sqrt(sum(float((v.float() ** 2).sum()) for v in u.values())) for u in updates]
    print(
        f"update norm: 1 strong (each) {', '.join(f'{x:.4f}' for x in singles)};"
        f" {len(updates)} strong (mean) {norm_mean:.4f}; ratio 1/{len(updates)} ="
        f" {np.mean(singles) / norm_mean:.3f} (pure noise: {math.sqrt(len(updates)):.2f},"
        " shared signal: 1)"
    )
    base = nll(fm, test, None)
    print(f"held-out reference NLL over {len(test)} test rows: base {base.mean():.4f}")
    one = nll(fm, test, {k: start[k] + updates[0].get(k, 0) for k in start})
    many = nll(fm, test, {k: start[k] + mean.get(k, 0) for k in start})
    print(
        f"  1 strong {one.mean():.4f} (− base {paired(one, base)});"
        f" {len(updates)} strong {many.mean():.4f} (− base {paired(many, base)};"
        f" − 1 strong {paired(many, one)}) [{time.process_time() - t0:.0f} CPU s]"
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grads")
    g.add_argument("--examples", type=int, default=32)
    g.add_argument("--out", type=Path, default=Path("/tmp/dpsyn_grads.npz"))
    s = sub.add_parser("snr")
    s.add_argument("--grads", type=Path, default=Path("/tmp/dpsyn_grads.npz"))
    t = sub.add_parser("train")
    t.add_argument(
        "--lora",
        default='{"r": 1, "alpha": 2, "dropout": 0.0, "freeze_a": true,'
        ' "target_modules": ["v_proj"]}',
    )
    t.add_argument("--clients", type=int, default=4)
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--planned", type=int, default=0)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--optimizer", default="sgd")
    t.add_argument("--lr", type=float, default=1.0)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--epsilon", type=float, default=8.0)
    t.add_argument("--test", type=int, default=200)
    t.add_argument("--sigma", type=float, default=None)
    t.add_argument("--only", default="", help="train only these strong clients (indices)")
    t.add_argument("--save", type=Path, default=Path("/tmp/dpsyn_updates"))
    t.add_argument("--score", action="store_true", help="score the saved updates only")
    pr = sub.add_parser("probe")
    pr.add_argument("--lora", default=t.get_default("lora"))
    pr.add_argument("--examples", type=int, default=32)
    pr.add_argument("--clip", type=float, default=1.0)
    pr.add_argument("--steps", default="0,1,3,10,30,100")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    {"grads": grads, "snr": snr, "train": train, "probe": probe}[args.cmd](args)


if __name__ == "__main__":
    main()
