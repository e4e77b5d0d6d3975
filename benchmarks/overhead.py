"""Overhead of fedfm's embedded runtime against a bare PyTorch FedAvg loop.

The same local training (10 clients x 5 rounds, an MLP of about 1.07 M parameters on
Fashion-MNIST, fixed steps, SGD) runs as a bare loop and through ``fedfm.engine.Engine``
(round loop, message validation, audit ledger, checkpoint after every round) in the same
process, alternating, median of repeats. Both evaluate the final model once and both pay the
same data preparation (load, partition, tensors) inside the timing, as a user of either does.
The ratio fedfm/bare is printed last; target <= 1.05. The ratio of the round loops alone
(fedfm's per-round times from metrics.jsonl against the bare loop without data preparation)
is printed before it.

Usage: .venv/bin/python benchmarks/overhead.py [--repeats 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedfm.config import load_config
from fedfm.core.federation import ClientContext, ClientState, derive_seed
from fedfm.engine import build
from fedfm.runtime import run


def config(out: str, steps: int) -> dict:
    return {
        "name": "overhead",
        "algorithm": "fedavg",
        "rounds": 5,
        "seed": 0,
        "task": {
            "kind": "image",
            "dataset": "fashion_mnist",
            "model": "mlp",
            "model_args": {"hidden": [1024, 256]},
            "max_train": 6000,
            "local_test_fraction": 0.0,
        },
        "partition": {"scheme": "iid", "num_clients": 10},
        "train": {"steps": steps, "batch_size": 32, "lr": 0.05, "optimizer": "sgd"},
        "eval_before": False,
        "eval_every": 1000,
        "out_dir": out,
        "plots": False,
        "threads": 1,
    }


def bare_fedavg(cfg_dict: dict) -> tuple[float, float]:
    """A plain FedAvg loop over the same task, model, batches and seeds.

    Returns:
        Seconds in all (data preparation included) and seconds of the round loop alone.
    """
    t_all = time.perf_counter()
    cfg = load_config(cfg_dict)
    task = build(cfg).task  # the same data preparation as fedfm's
    model = task.build_model(seed=cfg.seed)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        states, weights = [], []
        for cid in task.client_ids():
            model.load_state_dict(glob)
            ctx = ClientContext(cid, "default", rnd, cfg.seed, task, ClientState())
            torch.manual_seed(derive_seed(cfg.seed, rnd, cid, "train"))
            batches = task.batches(ctx.data, cfg.train.batch_size, ctx.rng_seed("batches"))
            opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
            model.train()
            for _ in range(cfg.train.steps):
                loss, _ = task.loss(model, next(batches))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(float(task.num_examples(ctx.data)))
        total = sum(weights)
        pairs = list(zip(states, weights, strict=True))
        glob = {k: sum(w / total * s[k] for s, w in pairs) for k in glob}
    model.load_state_dict(glob)
    task.evaluate(model, task.test_data())  # fedfm evaluates after the last round too
    end = time.perf_counter()
    return end - t_all, end - t0


def fedfm_fedavg(cfg_dict: dict) -> tuple[float, float]:
    """The same through the engine; returns seconds in all and seconds of the rounds."""
    t0 = time.perf_counter()
    cfg = load_config(cfg_dict)
    run(cfg, overwrite=True, progress=False)
    total = time.perf_counter() - t0
    metrics = Path(cfg.out_dir) / cfg.name / "metrics.jsonl"
    rounds = [json.loads(x) for x in metrics.read_text().splitlines()]
    return total, sum(r["time_s"] for r in rounds if r["round"] > 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = config(out, args.steps)
        fedfm_fedavg(cfg)  # warm-up: imports, data cache
        bare, fed = [], []
        for i in range(args.repeats):
            bare.append(bare_fedavg(cfg))
            fed.append(fedfm_fedavg(cfg))
            print(
                f"repeat {i}: bare {bare[-1][0]:.2f} s (loop {bare[-1][1]:.2f} s)"
                f"  fedfm {fed[-1][0]:.2f} s (rounds {fed[-1][1]:.2f} s)"
            )
    b, f = (statistics.median(x[0] for x in bare), statistics.median(x[0] for x in fed))
    bl, fl = (statistics.median(x[1] for x in bare), statistics.median(x[1] for x in fed))
    n = sum(p.numel() for p in build(load_config(cfg)).task.build_model().parameters())
    print(f"model parameters: {n:,}; 10 clients x 5 rounds x {args.steps} steps")
    print(f"median bare {b:.2f} s, median fedfm {f:.2f} s")
    print(f"ratio of round loops fedfm/bare: {fl / bl:.3f}")
    print(f"ratio fedfm/bare: {f / b:.3f}")


if __name__ == "__main__":
    main()
