"""Where a training worker's memory goes beyond what autograd keeps: the C allocator's free holes.

One client's local training on the LLM workload of ``vs_flower.py --llm`` (SmolLM2-135M-Instruct,
LoRA r=8 on q,k,v,o, bfloat16 autocast, batches of 4 rows of up to 128 tokens), in a fresh
process per allocator, the way a forked worker trains (:func:`map_large_allocations` on glibc):

* ``system``: the C library's malloc; at the end of each forward pass (a hook on the model's
  last norm) glibc's ``mallinfo2`` gives the heap's bytes in use and free (free bytes below
  the heap's top stay resident: holes);
* ``jemalloc``: the same with ``LD_PRELOAD`` of jemalloc, where the library is found (or
  ``--jemalloc PATH``); its heap is not glibc's, so only the peak RSS is compared.

Each child prints the peak RSS of its training (``VmHWM`` reset once the model is loaded; one
warm-up step, then the measured ones) above the RSS before it, and the mean time of a measured
step. Why glibc leaves holes (a reading, not measured here): torch asks for 64-byte aligned
blocks (``posix_memalign``), for which glibc looks for a free block 96 bytes larger than the
size; a freed activation's block fits the next request of its size only where the alignment
remainder beside it was merged back, which glibc's caches of small blocks often prevent.

Usage: .venv/bin/python benchmarks/heap_holes.py [--steps 8] [--jemalloc PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from fedfm.allocator import find_jemalloc

RESULT = "RESULT "  # the child's one line of JSON


class _MallInfo2(ctypes.Structure):
    _names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
    _fields_ = [(n, ctypes.c_size_t) for n in (*_names, "uordblks", "fordblks", "keepcost")]


def _status_mib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    raise KeyError(key)


def child(steps: int) -> dict[str, Any]:
    """Trains one client for ``steps`` steps after a warm-up one; its memory and time."""
    import torch

    import vs_flower  # this folder: the script's own
    from fedfm.config import load_config
    from fedfm.core.train import local_train
    from fedfm.engine import build
    from fedfm.runtime.workers import map_large_allocations

    torch.set_num_threads(1)
    glibc = "jemalloc" not in os.environ.get("LD_PRELOAD", "")
    with tempfile.TemporaryDirectory() as folder:
        size = vs_flower.LlmSize(steps=steps, clients=1, rounds=1)
        task = build(load_config(vs_flower.llm_config(folder, size, "heap"))).task
    model = task.build_model(seed=0)
    data, bs = task.client_data("0"), vs_flower.LLM_BATCH
    mallinfo2 = None
    if glibc:
        map_large_allocations()  # as a worker: blocks under 2 MiB come from the heap
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = _MallInfo2
    at_forward_end: list[tuple[int, int]] = []

    def sample(*_: Any) -> None:
        if mallinfo2 is not None:
            m = mallinfo2()
            at_forward_end.append((m.uordblks >> 20, m.fordblks >> 20))

    norm = next(mod for name, mod in model.named_modules() if name.endswith("model.norm"))
    norm.register_forward_hook(sample)
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    local_train(model, task.batches(data, bs, seed=999), task.loss, task.run.train, 1)
    t0 = time.perf_counter()
    local_train(model, task.batches(data, bs, seed=1000), task.loss, task.run.train, steps)
    secs = (time.perf_counter() - t0) / steps
    out: dict[str, Any] = {"allocator": "system" if glibc else "jemalloc", "rss_before": before}
    out.update(peak_rss=_status_mib("VmHWM"), step_s=secs)
    if at_forward_end:
        used, free = max(at_forward_end, key=lambda x: x[0] + x[1])
        out.update(heap_used=used, heap_free=free)
    return out


def run_child(steps: int, preload: str | None) -> Any:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"heap_holes: the {'jemalloc' if preload else 'system'} child failed: {tail}"
        )
    return json.loads(lines[-1][len(RESULT) :])


def _line(name: str, r: dict[str, Any]) -> str:
    above = r["peak_rss"] - r["rss_before"]
    return (
        f"{name}: peak RSS {r['peak_rss']} MiB ({above} above the {r['rss_before']} before"
        f" training), {r['step_s']:.2f} s a step"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps after one warm-up step")
    ap.add_argument("--jemalloc", default=None, help="jemalloc's library (default: searched)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(args.steps)), flush=True)
        return
    system = run_child(args.steps, None)
    print(_line("system malloc", system))
    if "heap_used" in system:
        print(
            f"  glibc heap at a forward pass's end: {system['heap_used']} MiB in use,"
            f" {system['heap_free']} MiB free in holes"
        )
    lib = args.jemalloc or find_jemalloc()  # where `fedfm run` looks
    if lib is None:
        print("jemalloc: not found on this machine (--jemalloc PATH to name it)")
        return
    je = run_child(args.steps, lib)
    print(_line(f"jemalloc ({lib})", je))
    print(f"peak RSS jemalloc/system: {je['peak_rss'] / system['peak_rss']:.3f}")


if __name__ == "__main__":
    main()
