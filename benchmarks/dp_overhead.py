"""Cost of a DP-SGD step against a plain step on the same SmolLM2 batch.

Both sides train one LoRA adapter (r=8, alpha=16 on q,k,v,o) of SmolLM2-135M-Instruct with
AdamW on the same 4 instruction rows (up to 128 tokens, response-only labels), on the same
shared PeftModel, in the same process:

* plain: fedfm's ordinary step (:func:`fedfm.core.train.local_train` with the instruction
  task's loss, i.e. Hugging Face's ``out.loss``), one optimizer step;
* DP-SGD: :func:`fedfm.core.dp.dp_step` (per-sample losses, Opacus per-sample gradients in hooks
  mode, clipping, Gaussian noise, the step), with the Opacus hooks added before and removed
  after the timed steps, as :func:`fedfm.core.dp.dp_train` does once per call (timed too).

Repeats alternate the order of the two sides; each times ``--steps`` steps. The median of the
paired ratios (DP-SGD time / plain time) is printed last; target <= 1.15.

Usage: .venv/bin/python benchmarks/dp_overhead.py [--repeats 5] [--steps 2] [--threads 1]
    [--bf16]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from opacus.optimizers import DPOptimizer

from fedfm.config import TrainConfig
from fedfm.core.dp import DPSGDConfig, dp_step, grad_sample_hooks
from fedfm.core.train import local_train, make_optimizer, trainable
from fedfm.data.prompt import PromptConfig, collate
from fedfm.data.sources import load_source
from fedfm.fm import FoundationModel
from fedfm.models.generation import pad_id_of
from fedfm.models.lora import LoraConfigSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per side and repeat")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fm = FoundationModel(
        "smollm2-135m-instruct",
        lora=LoraConfigSpec(),
        prompt=PromptConfig(max_length=128, max_prompt_length=96),
        autocast_bf16=args.bf16,
    )
    fm.ensure_adapter("global", seed=0)
    data = load_source("instruct_suite", per_domain_train=4, per_domain_test=1).train
    rows = fm.encode(data.shuffle(seed=0).select(range(4)))
    pad = pad_id_of(fm.tokenizer)
    batch = collate(rows, pad)
    tokens = int(batch["attention_mask"].sum())
    train = TrainConfig(optimizer="adamw", lr=1e-4, batch_size=len(rows))
    dp = DPSGDConfig(noise_multiplier=1.0, max_grad_norm=1.0, physical_batch_size=len(rows))

    def loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, object]:
        with fm.autocast():
            out = model(**b)
        return out.loss, out

    with fm.use(["global"], ["global"]) as model:
        model.train()
        params = list(trainable(model).values())
        plain_opt, dp_opt = make_optimizer(params, train), make_optimizer(params, train)
        noise = torch.Generator().manual_seed(0)

        def plain() -> float:
            t0 = time.perf_counter()
            local_train(
                model, itertools.repeat(batch), loss, train, args.steps, optimizer=plain_opt
            )
            return time.perf_counter() - t0

        def private() -> float:
            t0 = time.perf_counter()
            with grad_sample_hooks(model) as gsm:  # what dp_train does once per call
                private_opt = DPOptimizer(
                    dp_opt,
                    noise_multiplier=dp.noise_multiplier,
                    max_grad_norm=dp.max_grad_norm,
                    expected_batch_size=len(rows),
                    generator=noise,
                )
                for _ in range(args.steps):
                    dp_step(gsm, private_opt, rows, pad, dp, fm.autocast)
            return time.perf_counter() - t0

        private()  # warm-up of both sides (first-call allocations)
        plain()
        ratios, secs = [], {"plain": [], "dp": []}
        for rep in range(args.repeats):
            order = ("plain", "dp") if rep % 2 == 0 else ("dp", "plain")
            for side in order:
                secs[side].append(plain() if side == "plain" else private())
            ratios.append(secs["dp"][-1] / secs["plain"][-1])
            print(
                f"repeat {rep}: plain {secs['plain'][-1] / args.steps:.3f} s/step  "
                f"DP-SGD {secs['dp'][-1] / args.steps:.3f} s/step",
                flush=True,
            )
    mode = "bf16 autocast" if args.bf16 else "fp32"
    print(
        f"SmolLM2-135M + LoRA r=8 (q,k,v,o), AdamW, batch {len(rows)} rows / {tokens} tokens, "
        f"{args.steps} steps x {args.repeats} repeats, {mode}, {torch.get_num_threads()} threads"
    )
    print(
        f"median s/step: plain {statistics.median(secs['plain']) / args.steps:.3f}, "
        f"DP-SGD {statistics.median(secs['dp']) / args.steps:.3f}"
    )
    print(f"ratio time DP-SGD/plain (median of paired repeats): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
