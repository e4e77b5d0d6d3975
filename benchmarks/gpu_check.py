"""On a machine with CUDA: the CPU and the GPU give the same FedIT round, DP-SGD step and
generation batch, and how many tokens per second each computes.

The same base model is loaded twice, on the CPU and on the CUDA device (the loader places it:
``load_causal_lm(..., device=...)``), with the same seeded LoRA adapter (r=8 on q,k,v,o), in
float32 without autocast so that the two can be compared to float32 rounding:

* a FedIT round: two clients of the quickstart's instruction suite train 4 SGD steps each
  (batch 4) from the same global adapter on the same batches, and their adapters are averaged
  by example count (``fedfm.core.aggregate.weighted_mean``), as the server does;
* a DP-SGD step (``fedfm.core.dp.dp_train``, Opacus) on 8 rows with noise multiplier 0, so
  that clipping and averaging of per-sample gradients, not noise draws, are compared;
* a greedy generation batch of 8 prompts, 32 new tokens.

Tolerance: the relative L2 difference of the global adapter's update (and of the DP step's)
between the devices is at most 1e-3; the prompts' next-token logits differ by at most 1e-3 of
their largest magnitude, and at least 6 of the 8 greedy replies are identical (a near-tie may
flip a token and the rest of a reply with it). Tokens per second are printed for each device
(training: non-padding tokens; generation: new tokens). Exit code 1 when a check fails.

Without CUDA it says so and exits 0.

Usage: .venv/bin/python benchmarks/gpu_check.py [--model smollm2-135m-instruct] [--device cuda]
  (``--model`` also takes a hub id or folder, e.g. HuggingFaceTB/SmolLM2-1.7B-Instruct)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

TOLERANCE = 1e-3
STEPS, BATCH = 4, 4
PROMPTS = [
    "What is the capital of France?",
    "Name three fruits.",
    "Write one sentence about the sea.",
    "What is 12 minus 5?",
    "Why is the sky blue?",
    "Translate 'good morning' into German.",
    "Is this review positive or negative? The film was dull and far too long.",
    "Give a synonym of 'quick'.",
]


def load(model: str, device: torch.device) -> Any:
    """The base on ``device`` with one seeded adapter (``B = 0``), frozen base, float32."""
    from fedfm.models.causal_lm import load_causal_lm
    from fedfm.models.lora import LoraConfigSpec, add_adapters

    bundle = load_causal_lm(model, device=device)
    spec = LoraConfigSpec(r=8, alpha=16, dropout=0.0)
    return add_adapters(bundle.model, ["default"], spec, seed=0), bundle.tokenizer


def task_data(model: str) -> Any:
    """The quickstart's instruction task (data only; the model is loaded separately)."""
    from fedfm.config import load_config
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    overrides = ["task.autocast_bf16=false"]
    if model != "smollm2-135m-instruct":
        overrides += ["task.model=causal-lm", f"task.model_args.name_or_path={model}"]
    cfg = load_config("quickstart", overrides)
    _, task_cfg = resolve(cfg)
    return TASKS.get(task_cfg.kind)(task_cfg, cfg)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def fedit_round(model: Any, task: Any, device: torch.device) -> tuple[dict, int, float]:
    """Two clients' local SGD from the same global adapter, averaged by example count."""
    from fedfm.config import TrainConfig
    from fedfm.core.aggregate import weighted_mean
    from fedfm.core.train import get_params, local_train, set_params

    cfg = TrainConfig(steps=STEPS, batch_size=BATCH, optimizer="sgd", lr=0.05)
    start = get_params(model)
    states, weights, tokens, seconds = [], [], 0, 0.0
    for cid in ("0", "1"):
        set_params(model, start)
        data = task.client_data(cid)
        batches = list(_take(task.batches(data, BATCH, seed=int(cid)), STEPS))
        tokens += sum(int(b["attention_mask"].sum()) for b in batches)
        _, s = timed(device, lambda b=batches: local_train(model, iter(b), task.loss, cfg, STEPS))
        seconds += s
        states.append(get_params(model))
        weights.append(float(task.num_examples(data)))
    set_params(model, start)
    glob = weighted_mean(states, weights)
    return {k: glob[k] - start[k] for k in start}, tokens, seconds


def dp_step(model: Any, task: Any, tokenizer: Any) -> dict:
    """One DP-SGD step without noise: the adapter's update."""
    from fedfm.config import TrainConfig
    from fedfm.core.dp import DPSGDConfig, dp_train
    from fedfm.core.federation import ClientState
    from fedfm.core.train import get_params, set_params
    from fedfm.models.generation import pad_id_of

    rows = task.encode(task.client_data("0"))[:8]
    start = get_params(model)
    dp_train(
        model,
        rows,
        ClientState(),
        train=TrainConfig(optimizer="sgd", lr=0.5, batch_size=len(rows)),
        dp=DPSGDConfig(noise_multiplier=0.0, max_grad_norm=0.1, physical_batch_size=4),
        delta=1e-5,
        steps=1,
        planned_steps=1,
        seed=0,
        pad_id=pad_id_of(tokenizer),
    )
    after = get_params(model)
    set_params(model, start)
    return {k: after[k] - start[k] for k in start}


def generation(model: Any, tokenizer: Any, device: torch.device) -> tuple[list, Any, int, float]:
    """Greedy replies to PROMPTS and the next-token logits of each prompt."""
    from fedfm.models.causal_lm import format_chat, generate_text

    texts = [format_chat(tokenizer, p) for p in PROMPTS]
    tokenizer.padding_side = "left"  # the last position is each prompt's end
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "right"
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in enc.items()}).logits[:, -1].float().cpu()
    replies, seconds = timed(
        device, lambda: generate_text(model, tokenizer, PROMPTS, max_new_tokens=32, batch_size=8)
    )
    new_tokens = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
    return replies, logits, new_tokens, seconds


def _take(it: Any, n: int) -> Any:
    for _ in range(n):
        yield next(it)


def relative(a: dict, b: dict) -> float:
    """``||a - b|| / ||a||`` over every tensor."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    return (num / max(den, 1e-300)) ** 0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--device", default="cuda", help="the device to compare with the CPU (cpu: a self-check)"
    )
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: torch sees none on this machine, so there is nothing to compare")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    task = task_data(args.model)
    results: dict[str, dict[str, Any]] = {}
    for name in ("cpu", f"{args.device} "):  # the space keeps a cpu self-check's two entries
        device = torch.device(name.strip())
        model, tokenizer = load(args.model, device)
        update, tokens, seconds = fedit_round(model, task, device)
        try:
            dp = dp_step(model, task, tokenizer)
        except Exception as err:  # report, and go on to the other checks
            dp = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        replies, logits, new, gen_s = generation(model, tokenizer, device)
        results[name] = {"fedit": update, "dp": dp, "replies": replies, "logits": logits}
        print(
            f"{name.strip()}: training {tokens / seconds:,.0f} tokens/s, generation"
            f" {new / gen_s:,.1f} new tokens/s",
            flush=True,
        )
        del model
    cpu, gpu = results["cpu"], results[f"{args.device} "]
    failed = []
    fedit = relative(cpu["fedit"], gpu["fedit"])
    print(f"FedIT round: relative difference of the global update {fedit:.2e}")
    failed += ["FedIT round"] if fedit > TOLERANCE else []
    if "error" in cpu["dp"] or "error" in gpu["dp"]:
        print(f"DP-SGD step failed: cpu {cpu['dp'].get('error')}, gpu {gpu['dp'].get('error')}")
        failed.append("DP-SGD step")
    else:
        dp = relative(cpu["dp"], gpu["dp"])
        print(f"DP-SGD step (noise 0): relative difference of the update {dp:.2e}")
        failed += ["DP-SGD step"] if dp > TOLERANCE else []
    gap = float((cpu["logits"] - gpu["logits"]).abs().max())
    scale = float(cpu["logits"].abs().max())
    same = sum(a == b for a, b in zip(cpu["replies"], gpu["replies"], strict=True))
    print(f"generation: next-token logits differ by {gap / scale:.2e} of their scale; {same} of"
          f" {len(PROMPTS)} greedy replies identical")  # fmt: skip
    failed += ["generation"] if gap > TOLERANCE * scale or same < 6 else []
    print("all checks within tolerance" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
