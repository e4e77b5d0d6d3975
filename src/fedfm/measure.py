"""Memory of one client's local training, measured in a fresh process.

Used by the client-memory benchmark (``benchmarks/client_memory.py``) and the FedRD
reproduction study. Memory is sampled every 2 ms in a thread (:class:`RssSampler`), and the
increase of the anonymous resident memory (``RssAnon``) over its value just before the
client's model is built is the client's training memory: its model, the received parameters,
optimizer state, activations and gradients. The RSS increase, which adds library code pages
touched on first use, is reported too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def anon_rss() -> int | None:
    """Anonymous resident memory (``RssAnon`` of /proc/self/status) in bytes, or None.

    Anonymous pages hold the process's data: tensors, activations, optimizer state, Python
    objects. File-backed pages (library code touched on first use of an op) are left out:
    they are shared with every other torch process and are not training memory.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples this process's memory in a thread and keeps the maxima.

    Tracks the resident set size and its anonymous part (see :func:`anon_rss`; falls back
    to the RSS where /proc is missing). ``ru_maxrss`` alone cannot isolate one phase (it is
    the maximum over the whole process, imports and data loading included), hence sampling.
    """

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def rss(self) -> int:
        """Current resident set size in bytes."""
        return int(self._proc.memory_info().rss)

    def anon(self) -> int:
        """Current anonymous resident memory in bytes (the RSS where unknown)."""
        a = anon_rss()
        return self.rss() if a is None else a

    def _sample(self) -> None:
        self.peak = max(self.peak, self.rss())
        self.peak_anon = max(self.peak_anon, self.anon())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def client_training_memory(preset: str, overrides: list[str], cid: str = "0") -> dict[str, Any]:
    """One client's local training, measured in this (fresh) process.

    The same libraries are imported in every measurement, torch's lazy one-time set-up is
    done (:func:`_warm_up`) and the client's data are built before the baseline, so the
    increase covers what the client's training adds: its model
    (the student, or the foundation model with LoRA), the received parameters, optimizer
    state, activations and gradients of one round of local training.
    """
    import gc
    import resource

    import peft  # noqa: F401  (imported in every measurement, see above)
    import sentence_transformers  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import fedfm.tasks.text  # noqa: F401
    from fedfm.algorithms.base import ALGORITHMS, client_half
    from fedfm.algorithms.fedavg import FedAvgClient
    from fedfm.config import load_config
    from fedfm.core.federation import ClientContext
    from fedfm.core.messages import Message
    from fedfm.core.state import ClientState
    from fedfm.core.train import get_params
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    torch.set_num_threads(1)
    cfg = load_config(preset, overrides)
    algo_cfg, task_cfg = resolve(cfg)
    task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
    n = task.num_examples(task.client_data(cid))
    _warm_up(cfg.train)
    gc.collect()
    t = time.perf_counter()
    with RssSampler() as mem:
        base, base_anon = mem.rss(), mem.anon()
        # The client half alone, as a client's process builds it: its model, no server state.
        client = client_half(ALGORITHMS.get(cfg.algorithm), algo_cfg, task, cfg)
        assert isinstance(client, FedAvgClient), f"{cfg.algorithm} is not FedAvg-style"
        model = client.model
        ctx = ClientContext(cid, "default", 1, cfg.seed, task, ClientState())
        reply = client.train(ctx, Message("train", {"params": get_params(model)}))
    params = list(model.parameters())
    return {
        "preset": preset,
        "algorithm": cfg.algorithm,
        "model": task_cfg.model,
        "client_examples": n,
        "steps": cfg.train.steps,
        "batch_size": cfg.train.batch_size,
        "params_on_client": sum(p.numel() for p in params),
        "params_trainable": sum(p.numel() for p in params if p.requires_grad),
        "params_sent": sum(v.numel() for v in reply.arrays["params"].values()),
        "baseline_mb": base / 2**20,
        "peak_mb": mem.peak / 2**20,
        "rss_increase_mb": (mem.peak - base) / 2**20,
        "train_mb": (mem.peak_anon - base_anon) / 2**20,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - t,
    }


def _warm_up(train: Any) -> None:
    """One step of a 1-parameter model with the client's optimizer, before the baseline.

    Torch initialises allocator arenas, autograd and optimizer code lazily on first use; this
    one-time cost is the same for every client (like a GPU's CUDA context), so it is paid
    before the baseline rather than charged to whichever client trains first.
    """
    import torch

    from fedfm.core.train import local_train

    lin = torch.nn.Linear(1, 1)

    def batches() -> Any:
        while True:
            yield torch.ones(2, 1), torch.zeros(2, 1)

    def loss(model: Any, batch: Any) -> Any:
        out = model(batch[0])
        return ((out - batch[1]) ** 2).mean(), out

    local_train(lin, batches(), loss, train, 1)


def measure_client_memory(preset: str, overrides: Sequence[str] = (), cid: str = "0") -> dict:
    """Runs :func:`client_training_memory` in a fresh interpreter and returns its measurement.

    Raises:
        RuntimeError: The child failed (its last lines of stderr are included).
    """
    call = f"client_training_memory({preset!r}, {list(overrides)!r}, {cid!r})"
    code = (
        "import json; from fedfm.measure import client_training_memory; "
        f"print('@@' + json.dumps({call}))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"memory measurement of {preset} failed:\n{tail}")
    return json.loads(lines[-1][2:])


def memory_table(
    clients: Mapping[str, tuple[str, Sequence[str]]], repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Client training memory of several clients, each measured in its own fresh process.

    Measurements are repeated ``repeats`` times, interleaved across clients (machines are
    noisy); memory figures are medians, with the range of the training memory kept as
    ``train_mb_min``/``train_mb_max``. A failed measurement gives ``{"error": ...}``.

    Args:
        clients: Label -> (preset, ``key=value`` overrides) of the client to measure.
        repeats: Measurements per client.

    Returns:
        Label -> measurement (see :func:`client_training_memory`).
    """
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in clients}
    out: dict[str, dict[str, Any]] = {}
    for _ in range(max(1, repeats)):
        for label, (preset, overrides) in clients.items():
            if label in out:
                continue
            try:
                runs[label].append(measure_client_memory(preset, overrides))
            except RuntimeError as e:
                out[label] = {"error": str(e).splitlines()[0]}
    for label, rs in runs.items():
        if label in out or not rs:
            continue
        agg = dict(rs[0])
        for key in ("train_mb", "rss_increase_mb", "peak_mb", "baseline_mb", "seconds"):
            agg[key] = float(np.median([r[key] for r in rs]))
        agg["train_mb_min"] = min(r["train_mb"] for r in rs)
        agg["train_mb_max"] = max(r["train_mb"] for r in rs)
        agg["repeats"] = len(rs)
        out[label] = agg
    return out
