"""Training throughput of fedfm's local step against a bare transformers + peft loop.

Both sides train LoRA (r=8, alpha=16, dropout 0.05 on q,k,v,o) on SmolLM2-135M-Instruct with
AdamW on the same batches of the instruction suite (4 rows of up to 160 tokens, response-only
labels), under the same bfloat16 autocast setting, in the same process:

* fedfm: :func:`fedfm.core.train.local_train` with :meth:`InstructionTask.loss` on batches drawn
  live from :meth:`InstructionTask.batches` (tokenised data, shuffling and collation included),
  on the task's shared PeftModel;
* bare: ``AutoModelForCausalLM.from_pretrained`` + ``peft.get_peft_model`` and a plain
  ``loss.backward(); opt.step()`` loop over the same batches, collated beforehand.

Repeats alternate the order of the two sides; tokens/s counts non-padding tokens. The ratio
fedfm/bare of each repeat is taken and their median printed last; target >= 0.95.

Usage: .venv/bin/python benchmarks/throughput.py [--repeats 5] [--steps 4] [--threads N] [--fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import peft
import torch
from transformers import AutoModelForCausalLM

import fedfm.tasks.lm as lm
from fedfm.config import load_config
from fedfm.core.train import local_train
from fedfm.engine import build
from fedfm.models.causal_lm import smollm2_dir

LR = 5e-4


def task_config(out: str, autocast: bool) -> dict[str, Any]:
    return {
        "name": "throughput",
        "out_dir": out,
        "task": {
            "kind": "instruction",
            "model": "smollm2-135m-instruct",
            "autocast_bf16": autocast,
            "source_options": {"per_domain_train": 40, "per_domain_test": 2},
            "prompt": {"max_length": 160, "max_prompt_length": 128},
        },
        "partition": {"scheme": "iid", "num_clients": 1},
        "train": {"steps": 4, "batch_size": 4, "optimizer": "adamw", "lr": LR},
    }


def bare_model(spec: lm.LoraConfigSpec) -> peft.PeftModel:
    """SmolLM2 from the converted folder with peft's LoRA, built the way peft documents it."""
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(base, config)


def bare_steps(
    model: peft.PeftModel, batches: list[dict[str, torch.Tensor]], autocast: bool
) -> float:
    """A plain LoRA training loop; returns seconds."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    model.train()
    t0 = time.perf_counter()
    for batch in batches:
        with ctx:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def fedfm_steps(task: lm.InstructionTask, model: Any, batches: Iterator[Any], steps: int) -> float:
    """fedfm's local step as every algorithm runs it; returns seconds."""
    cfg = task.run.train
    t0 = time.perf_counter()
    local_train(model, batches, task.loss, cfg, steps)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per repeat")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--fp32", action="store_true", help="no bfloat16 autocast")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    autocast = not args.fp32
    with tempfile.TemporaryDirectory() as out:
        task = build(load_config(task_config(out, autocast))).task
    data = task.client_data("0")
    fedfm_model = task.build_model(seed=0)
    bare = bare_model(task.cfg.lora)
    bs = task.run.train.batch_size
    # Warm-up of both sides (first-call allocations, autocast caches).
    fedfm_steps(task, fedfm_model, task.batches(data, bs, seed=999), 1)
    warm = task.batches(data, bs, seed=999)
    bare_steps(bare, [next(warm)], autocast)
    rates: dict[str, list[float]] = {"fedfm": [], "bare": []}
    for rep in range(args.repeats):
        seed = 1000 + rep
        draw = task.batches(data, bs, seed)
        same = [next(draw) for _ in range(args.steps)]  # what fedfm's iterator will yield
        tokens = sum(lm.tokens_in(b) for b in same)
        order = ("fedfm", "bare") if rep % 2 == 0 else ("bare", "fedfm")
        for side in order:
            if side == "fedfm":
                secs = fedfm_steps(task, fedfm_model, task.batches(data, bs, seed), args.steps)
            else:
                secs = bare_steps(bare, same, autocast)
            rates[side].append(tokens / secs)
        print(
            f"repeat {rep}: {tokens} tokens  fedfm {rates['fedfm'][-1]:.1f} tok/s"
            f"  bare {rates['bare'][-1]:.1f} tok/s",
            flush=True,
        )
    fed, bar = statistics.median(rates["fedfm"]), statistics.median(rates["bare"])
    # Each repeat runs both sides back to back, so its ratio is little affected by other load
    # on the machine drifting between repeats; the median of these paired ratios is reported.
    paired = statistics.median(f / b for f, b in zip(rates["fedfm"], rates["bare"], strict=True))
    mode = "fp32" if args.fp32 else "bf16 autocast"
    print(
        f"SmolLM2-135M LoRA r={task.cfg.lora.r}, batch {bs}, {args.steps} steps x "
        f"{args.repeats} repeats, {mode}, {torch.get_num_threads()} threads"
    )
    print(f"median tokens/s: fedfm {fed:.1f}, bare transformers+peft {bar:.1f}")
    print(f"ratio tokens/s fedfm/bare (median of paired repeats): {paired:.3f}")


if __name__ == "__main__":
    main()
