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

Where the tensors lived (the check that nothing computes on the CPU by mistake): on each
device, every stage above records the device of the token ids that reached the model's input
embedding (a forward pre-hook), of the frozen base weights and of the trainable adapters, and
of what the stage hands back (the averaged update, the DP step's update: CPU tensors, as
messages are); and the peak memory of the stage (CUDA: ``torch.cuda.max_memory_allocated``
from a reset before the stage; CPU: the process's peak resident set so far). Then, on the
compared device only, **the quickstart round**: ``fedfm run quickstart`` itself for one round
(evaluation before and after, generation included) with ``device=<device>``, through the
embedded runtime, printing its wall time, peak memory, the devices the model's inputs came
on, and the devices of every array in the clients' replies (what leaves a client: all
``cpu``). A stage whose inputs reached the model on another device than the model's, or a
reply tensor off the CPU, fails the check.

Without CUDA it says so and exits 0.

Usage: .venv/bin/python benchmarks/gpu_check.py [--model smollm2-135m-instruct] [--device cuda]
  [--no-quickstart]
  (``--model`` also takes a hub id or folder, e.g. HuggingFaceTB/SmolLM2-1.7B-Instruct;
  ``--device cpu`` runs every stage twice on the CPU, a self-check of this script)
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
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


def model_overrides(model: str) -> list[str]:
    """The quickstart's overrides that put ``model`` in place of SmolLM2-135M."""
    if model == "smollm2-135m-instruct":
        return []
    return ["task.model=causal-lm", f"task.model_args.name_or_path={model}"]


def task_data(model: str) -> Any:
    """The quickstart's instruction task (data only; the model is loaded separately)."""
    from fedfm.config import load_config
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    cfg = load_config(
        "quickstart", ["device=cpu", "task.autocast_bf16=false", *model_overrides(model)]
    )
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
    from fedfm.data.prompt import PromptConfig, chat_prompt
    from fedfm.models.generation import generate

    texts = [chat_prompt(tokenizer, p, None, PromptConfig()) for p in PROMPTS]
    tokenizer.padding_side = "left"  # the last position is each prompt's end
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "right"
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in enc.items()}).logits[:, -1].float().cpu()
    replies, seconds = timed(
        device, lambda: generate(model, tokenizer, texts, max_new_tokens=32, batch_size=8)
    )
    new_tokens = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
    return replies, logits, new_tokens, seconds


class Inputs:
    """Records the device of the token ids reaching ``model``'s input embedding."""

    def __init__(self, model: Any) -> None:
        self.seen: set[str] = set()
        hook = lambda _m, args: self.seen.add(str(args[0].device))  # noqa: E731
        self.handle = model.get_input_embeddings().register_forward_pre_hook(hook)

    def take(self) -> set[str]:
        """The devices seen since the last call."""
        seen, self.seen = self.seen, set()
        return seen

    def close(self) -> None:
        self.handle.remove()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> str:
    """Peak memory of the stage (CUDA) or of the process so far (CPU: resident set)."""
    if device.type == "cuda":
        return f"peak {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return f"process peak RSS {rss:,.0f} MiB"


def devices_of(tensors: Any) -> set[str]:
    """Devices of the tensors in a ``name -> tensor`` dict, or of a model's parameters."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return {str(t.device) for t in values if isinstance(t, torch.Tensor)}


def placement(model: Any) -> tuple[set[str], set[str]]:
    """Devices of the frozen base weights and of the trainable tensors."""
    frozen = devices_of(p for p in model.parameters() if not p.requires_grad)
    return frozen, devices_of(p for p in model.parameters() if p.requires_grad)


def quickstart_round(model: str, device: torch.device) -> list[str]:
    """``fedfm run quickstart`` for one round on ``device``; the failures it shows.

    Prints its wall time, peak memory, where the model's inputs and the clients' replies were.
    """
    from fedfm.config import load_config
    from fedfm.core import federation
    from fedfm.engine import resolve
    from fedfm.progress import summary_line
    from fedfm.runtime import run as run_config
    from fedfm.tasks.lm import foundation_model_for

    replies: set[str] = set()
    check = federation.validate_reply

    def recorded(cid: str, reply: Any, like: Any) -> None:
        replies.update(d for field in reply.arrays.values() for d in devices_of(field))
        check(cid, reply, like)

    with tempfile.TemporaryDirectory() as out:
        overrides = [f"device={device}", "rounds=1", "eval_every=1", "name=gpu-check"]
        cfg = load_config("quickstart", [*overrides, f"out_dir={out}", *model_overrides(model)])
        _, task_cfg = resolve(cfg)
        base = foundation_model_for(task_cfg, cfg.torch_device()).bundle.model  # the run's base
        inputs = Inputs(base)
        federation.validate_reply = recorded  # type: ignore[assignment]
        reset_peak(device)
        try:
            summary, seconds = timed(device, lambda: run_config(cfg, progress=False))
        finally:
            federation.validate_reply = check
            inputs.close()
        frozen, _ = placement(base)
        seen = inputs.take()
        print(
            f"quickstart round on {device}: {seconds:.1f} s, {peak(device)}; base weights on"
            f" {sorted(frozen)}, model inputs on {sorted(seen)}, reply tensors on"
            f" {sorted(replies)}; {summary_line(summary, out)}",
            flush=True,
        )
    return [] if seen == frozen and replies == {"cpu"} else ["quickstart round"]


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
    ap.add_argument(
        "--no-quickstart", action="store_true", help="skip the quickstart round on the device"
    )
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: torch sees none on this machine, so there is nothing to compare")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    task = task_data(args.model)
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for name in ("cpu", f"{args.device} "):  # the space keeps a cpu self-check's two entries
        device = torch.device(name.strip())
        model, tokenizer = load(args.model, device)
        inputs = Inputs(model)
        frozen, adapters = placement(model)
        print(f"{device}: base weights on {sorted(frozen)}, adapters on {sorted(adapters)}")
        reset_peak(device)
        update, tokens, seconds = fedit_round(model, task, device)
        seen = {"FedIT round": (inputs.take(), devices_of(update), peak(device))}
        reset_peak(device)
        try:
            dp = dp_step(model, task, tokenizer)
        except Exception as err:  # report, and go on to the other checks
            dp = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        seen["DP-SGD step"] = (inputs.take(), devices_of(dp), peak(device))
        reset_peak(device)
        replies, logits, new, gen_s = generation(model, tokenizer, device)
        seen["generation"] = (inputs.take(), devices_of({"logits": logits}), peak(device))
        inputs.close()
        results[name] = {"fedit": update, "dp": dp, "replies": replies, "logits": logits}
        for stage, (where, out, mem) in seen.items():
            print(f"  {stage}: model inputs on {sorted(where)}, results on {sorted(out)}, {mem}")
            if where != frozen:  # the inputs reached the model where its weights are
                failed.append(f"{stage} on {device} (model inputs)")
        print(
            f"{name.strip()}: training {tokens / seconds:,.0f} tokens/s, generation"
            f" {new / gen_s:,.1f} new tokens/s",
            flush=True,
        )
        del model
    if not args.no_quickstart:
        failed += quickstart_round(args.model, torch.device(args.device))
    cpu, gpu = results["cpu"], results[f"{args.device} "]
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
