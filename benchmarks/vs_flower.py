"""The same FedAvg workload on fedfm's embedded runtime and on Flower's simulation engine.

Workload: 10 clients x 5 rounds x 20 fixed local steps (batch 32, SGD), an MLP of about
1.07 M parameters on Fashion-MNIST, one torch thread per process. Both runs go through the
fedfm engine (same config, same seed: the final metrics must agree); the embedded runtime
keeps every client in this process, ``runtime=flower-sim`` runs a Flower ServerApp in this
process and one ClientApp per virtual SuperNode in Ray actors (as many actors at once as
the machine has CPUs). Wall time includes what a user pays: task build, Ray start, actor
start-up. The ratio flower/embedded is printed last (target >= 3: the embedded runtime
should be at least three times faster than Flower's simulation engine on small workloads).

It also runs the workload on Flower's deployment engine (a SuperLink and one SuperNode per
client on 127.0.0.1, each SuperNode with its fedfm warm worker, or Flower's process per
message with ``--isolation subprocess``) and reports each SuperNode's peak memory: the
resident set of the SuperNode process, its children and its worker, sampled every 0.2 s.

Usage: .venv/bin/python benchmarks/vs_flower.py [--repeats 1] [--steps 20] [--skip-deploy]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from fedfm.config import load_config
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower.simulation import run_flower_sim


def config(out: str, steps: int, name: str, clients: int = 10) -> dict:
    """The workload (the same as benchmarks/overhead.py)."""
    return {
        "name": name,
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
        "partition": {"scheme": "iid", "num_clients": clients},
        "train": {"steps": steps, "batch_size": 32, "lr": 0.05, "optimizer": "sgd"},
        "eval_before": False,
        "eval_every": 1000,
        "out_dir": out,
        "plots": False,
        "threads": 1,
    }


def embedded(cfg: dict) -> float:
    t0 = time.perf_counter()
    run(load_config(cfg), overwrite=True, progress=False)
    return time.perf_counter() - t0


def flower_sim(cfg: dict, sim_cpus: int | None) -> float:
    t0 = time.perf_counter()
    run_flower_sim(
        load_config({**cfg, "runtime": "flower-sim"}),
        overwrite=True,
        progress=False,
        options={"sim_cpus": sim_cpus},
    )
    return time.perf_counter() - t0


def final(out: str, name: str) -> dict:
    rows = [json.loads(x) for x in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
    return {k: v for k, v in rows[-1].items() if k != "time_s"}


class PeakRss:
    """Samples the resident memory of process trees (a SuperNode, and its worker).

    ``peak[name]`` is the peak of the group's total; ``parts[name]`` the peak of each of
    its processes (with their children) on its own.
    """

    def __init__(self, groups: dict[str, list[int]], every_s: float = 0.2) -> None:
        self.groups = groups
        self.peak = dict.fromkeys(groups, 0)
        self.parts = {name: [0] * len(pids) for name, pids in groups.items()}
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss(pid: int) -> int:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for q in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += q.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pids in self.groups.items():
                each = [self._rss(pid) for pid in pids]
                self.peak[name] = max(self.peak[name], sum(each))
                self.parts[name] = [max(a, b) for a, b in zip(self.parts[name], each, strict=True)]
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def deployment(out: str, steps: int, clients: int, isolation: str) -> tuple[float, PeakRss]:
    """The workload on SuperLink + SuperNodes on loopback; (seconds, memory samples)."""
    work = Path(out) / "deploy"
    port = P.free_port()
    procs: list[P.Proc] = []
    groups: dict[str, list[int]] = {}
    try:
        for i in range(clients):
            started = D.start_client(
                f"127.0.0.1:{port}",
                i,
                clients,
                work / f"node{i}",
                work / "logs",
                isolation=isolation,
            )
            procs += started
            groups[f"supernode {i}"] = [p.popen.pid for p in started]
        cfg = load_config({**config(out, steps, "deploy", clients), "runtime": "flower"})
        with PeakRss(groups) as mem:
            t0 = time.perf_counter()
            D.serve(
                cfg,
                overwrite=True,
                options={"node_wait_s": 300, "timeout_s": 900},
                host="127.0.0.1",
                port=port,
                echo=False,
                work_dir=work / "serve",
            )
            wall = time.perf_counter() - t0
        return wall, mem
    finally:
        P.stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sim-cpus", type=int, default=None, help="CPUs for Ray (default: all)")
    ap.add_argument("--skip-deploy", action="store_true")
    ap.add_argument("--isolation", default="process", choices=["process", "subprocess"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        emb_cfg = config(out, args.steps, "embedded")
        sim_cfg = config(out, args.steps, "flower-sim")
        embedded(emb_cfg)  # warm-up: imports and the dataset cache, paid once per machine
        emb, sim = [], []
        for i in range(args.repeats):
            emb.append(embedded(emb_cfg))
            sim.append(flower_sim(sim_cfg, args.sim_cpus))
            print(f"repeat {i}: embedded {emb[-1]:.2f} s  flower-sim {sim[-1]:.2f} s", flush=True)
        same = final(out, "embedded") == final(out, "flower-sim")
        print(f"final metrics equal on both runtimes: {same}  ({final(out, 'embedded')})")
        if not args.skip_deploy:
            wall, mem = deployment(out, args.steps, 10, args.isolation)
            print(f"deployment engine ({args.isolation} isolation, 10 SuperNodes): {wall:.1f} s")
            for name, rss in mem.peak.items():
                parts = " + ".join(f"{x / 2**20:.0f}" for x in mem.parts[name])
                what = "SuperNode tree + worker" if len(mem.parts[name]) > 1 else "SuperNode tree"
                print(f"  {name}: peak RSS {rss / 2**20:.0f} MiB ({what}: {parts} MiB)")
            vals = list(mem.peak.values())
            print(
                f"  per SuperNode: median {statistics.median(vals) / 2**20:.0f} MiB,"
                f" max {max(vals) / 2**20:.0f} MiB, total {sum(vals) / 2**30:.2f} GiB"
            )
            same = final(out, "embedded") == final(out, "deploy")
            print(f"final metrics equal on the deployment engine: {same}")
    e, s = statistics.median(emb), statistics.median(sim)
    work = f"10 clients x 5 rounds x {args.steps} steps"
    print(f"{work}: median embedded {e:.2f} s, flower-sim {s:.2f} s")
    print(f"ratio flower/embedded: {s / e:.2f}")


if __name__ == "__main__":
    main()
