"""How close ``fedfm plan`` comes to the peak memory a run really reaches (target: within 25%).

Each case runs in a fresh process: the libraries are imported and torch's lazy one-time
set-up is done (one optimizer step of a 1-parameter model, as ``fedfm.measure`` does), then
the resident set size is sampled every 2 ms while ``fedfm run`` runs the whole config (task
data, the base model, every round, every evaluation). The measured peak is the highest RSS
minus the RSS just before the run (on CUDA: ``torch.cuda.max_memory_allocated``); the estimate
is the plan's peak of that process. Cases: the quickstart preset as shipped, and a tiny
random Llama run (4 layers, 384 wide, float32, batch 8 x 128 tokens, two clients, one round
with evaluation before and after).

Usage: .venv/bin/python benchmarks/plan_accuracy.py [--cases quickstart tiny] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from typing import Any

TINY = {
    "name": "plan-tiny",
    "rounds": 1,
    "seed": 0,
    "algorithm": "fedavg",
    "plots": False,
    "task": {
        "kind": "instruction",
        "model": "tiny-llama",
        "model_args": {"vocab": "small", "hidden": 384, "layers": 4, "heads": 4, "seed": 0},
        "source_options": {"per_domain_train": 16, "per_domain_test": 4},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": "auto"},
        "prompt": {"max_length": 128, "max_prompt_length": 96},
        "max_eval": 12,
        "max_new_tokens": 8,
        "eval_batch_size": 8,
        "pad_to_multiple_of": 128,
    },
    "partition": {"scheme": "iid", "num_clients": 2},
    "train": {"steps": 3, "batch_size": 8, "optimizer": "adamw", "lr": 1e-3},
}
CASES: dict[str, Any] = {"quickstart": "quickstart", "tiny": TINY}


def child(case: str, threads: int) -> None:
    """Measures one case in this fresh process and prints one JSON line."""
    import gc

    import peft  # noqa: F401  (imported before the baseline, as the run would)
    import torch
    import transformers  # noqa: F401

    import fedfm.tasks.lm  # noqa: F401
    from fedfm.algorithms import algo_keys
    from fedfm.config import load_config
    from fedfm.measure import RssSampler, _warm_up
    from fedfm.plan import make_plan
    from fedfm.runtime import run

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(CASES[case], [f"out_dir={out}", f"threads={threads}"], algo_keys)
        _warm_up(cfg.train)
        gc.collect()
        cuda = cfg.torch_device().type == "cuda"
        with RssSampler() as mem:
            base = mem.rss()
            plan = make_plan(cfg)  # reads the task's data, as the run's start does
            run(cfg, progress=False)
        peak = torch.cuda.max_memory_allocated() if cuda else mem.peak - base
    print(
        "@@"
        + json.dumps(
            {
                "case": case,
                "estimate": plan.process,
                "measured": peak,
                "parts": {**plan.server.parts, **plan.client.parts},
                "summary": plan.summary(),
            }
        )
    )


def measure(case: str, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", case, "--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [x for x in res.stdout.splitlines() if x.startswith("@@")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"case {case} failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.threads)
        return
    ratios = []
    for case in args.cases:
        r = measure(case, args.threads)
        ratio = r["estimate"] / r["measured"]
        ratios.append(f"{case} {ratio:.3f}")
        print(
            f"{case}: estimated peak {r['estimate'] / 2**20:,.0f} MiB, measured"
            f" {r['measured'] / 2**20:,.0f} MiB, estimate/measured {ratio:.3f}",
            flush=True,
        )
    print("ratio estimate/measured: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
