"""The same FedAvg workload on fedfm's embedded runtime and on Flower's simulation engine.

Workload: 10 clients x 5 rounds x 20 fixed local steps (batch 32, SGD), an MLP of about
1.07 M parameters on Fashion-MNIST, one torch thread per process. Both runs go through the
fedfm engine (same config, same seed: the final metrics must agree); the embedded runtime
keeps every client in this process, ``runtime=flower-sim`` runs a Flower ServerApp in this
process and one ClientApp per virtual SuperNode in Ray actors (as many actors at once as
the machine has CPUs). Wall time includes what a user pays: task build, Ray start, actor
start-up. The ratio flower/embedded is printed last (target >= 3: the embedded runtime
should be at least three times faster than Flower's simulation engine on small workloads).
The final global parameters of the two runtimes are compared (the same engine on both: they
must be equal, tolerance 0); the script exits 1 with one line when they differ.

It also runs the workload on Flower's deployment engine (a SuperLink and one SuperNode per
client on 127.0.0.1, each SuperNode with its fedfm warm worker, or Flower's process per
message with ``--isolation subprocess``) and reports each SuperNode's peak memory: the
resident set of the SuperNode process, its children and its worker, sampled every 0.2 s.

The LLM case (``--llm``): FedIT on SmolLM2-135M-Instruct (LoRA r=8 on q,k,v,o, bfloat16
autocast), 10 clients, 2 rounds, the same local steps on the same token batches, once by fedfm's
embedded runtime and once by a plain Flower simulation laid out as FlowerTune lays it out: a
ServerApp running Flower's own FedAvg strategy over the LoRA arrays, and a ClientApp whose
``train`` loads the base model from disk and wraps it with peft on every call (FlowerTune's
``get_model``), sets the received adapter, trains and replies. Each side runs in a fresh
process; its wall time and the peak of the resident memory summed over its process tree (Ray's
workers and daemons included) are measured from outside. Both sides get every core: Flower one
Ray actor of one thread per core (each client its own process), fedfm ``--llm-threads`` torch
threads shared by its clients trained side by side in worker processes forked from the server
(``clients.parallel``, ``--llm-parallel``: auto, from the cores and the memory plan), which
share the one base. The ratios flower/fedfm of wall time and of peak memory are printed last
(targets: fedfm wall <= 0.75x Flower's, fedfm peak <= 0.5x Flower's summed peak). Each side
runs under the C allocator its own command would: fedfm's child under the one ``fedfm run``
starts with (jemalloc where installed, on glibc: :mod:`fedfm.allocator`), Flower's under this
script's; ``LD_PRELOAD`` of jemalloc puts both on jemalloc, ``FEDFM_ALLOCATOR=system`` both
on the C library's. Each side's line names its allocator.

The final global adapters of the two sides are compared tensor by tensor: Flower's arrays are
keyed by the peft model's parameter names (``...q_proj.lora_A.default.weight``), fedfm's by
peft's saved keys (``...q_proj.lora_A.weight``), so Flower's are mapped to saved keys by peft
itself (``get_peft_model_state_dict`` over a peft model built on the meta device). The script
exits 1 with one line when the adapters share no tensor or differ by more than
``--tolerance`` (largest absolute difference of an element).

Usage: .venv/bin/python benchmarks/vs_flower.py [--repeats 1] [--steps 20] [--skip-deploy]
       .venv/bin/python benchmarks/vs_flower.py --llm [--llm-steps 4] [--llm-clients 10]
           [--llm-rounds 2] [--llm-parallel auto] [--tolerance 1e-3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedfm.config import load_config
from fedfm.core.agreement import compare_tensors
from fedfm.runtime import run
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import deploy_client as DC
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


def final_params(run_folder: Path) -> dict[str, Any]:
    """The global parameters of a fedfm run's last checkpoint (the one key format)."""
    from fedfm.core.checkpoint import checkpoints_newest_first, load_checkpoint
    from fedfm.core.groups import get_group

    last = checkpoints_newest_first(run_folder / "checkpoints")[0]
    return get_group(load_checkpoint(last).server_arrays, "params")


def check_agreement(what: str, ours: dict[str, Any], theirs: dict[str, Any], tol: float) -> bool:
    """Prints the comparison of two final models in one line; whether they agree."""
    agreement = compare_tensors(ours, theirs, tol)
    print(f"{what}: {agreement.line()}", flush=True)
    return agreement.ok


class PeakRss:
    """Samples the resident memory of process trees (a SuperNode, and its worker).

    ``peak[name]`` is the peak of the group's total; ``parts[name]`` the peak of each of
    its processes (with their children) on its own. ``pss[name]`` is the peak of the group's
    total proportional set size (Linux): a page shared by k processes counts 1/k in each, so
    the sum over processes is the memory they use together. A resident-set sum counts a page
    each process shares (a forked worker's copy-on-write base, libraries) once per process.
    """

    def __init__(self, groups: dict[str, list[int]], every_s: float = 0.2) -> None:
        self.groups = groups
        self.peak = dict.fromkeys(groups, 0)
        self.pss = dict.fromkeys(groups, 0)
        self.parts = {name: [0] * len(pids) for name, pids in groups.items()}
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _pss(pid: int) -> int:
        """Proportional set size of one process (0 where /proc does not tell it)."""
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    @classmethod
    def _rss(cls, pid: int) -> tuple[int, int]:
        """Resident and proportional set sizes of a process and its children, summed."""
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0, 0
        rss = pss = 0
        for q in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                rss += q.memory_info().rss
                pss += cls._pss(q.pid)
        return rss, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pids in self.groups.items():
                both = [self._rss(pid) for pid in pids]
                each = [rss for rss, _ in both]
                self.pss[name] = max(self.pss[name], sum(pss for _, pss in both))
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
            started = DC.start_client(
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


# ----------------------------------------------------------------------------- the LLM case

LLM_CLIENTS, LLM_ROUNDS, LLM_BATCH = 10, 2, 4
# Largest |fedfm - Flower| of an adapter element that counts as the same adapter: both sides
# train the same batches in bfloat16 autocast, but not through the same code (fedfm's loop,
# Flower's plain one), so their roundings may differ (ours).
LLM_TOLERANCE = 1e-3
LORA = {
    "r": 8,
    "alpha": 16,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


@dataclass(frozen=True)
class LlmSize:
    """The LLM case's size: local steps, clients and rounds (reduced for a correctness run)."""

    steps: int = 4
    clients: int = LLM_CLIENTS
    rounds: int = LLM_ROUNDS

    def args(self) -> list[str]:
        """The command-line options that give this size."""
        return [
            *("--llm-steps", str(self.steps), "--llm-clients", str(self.clients)),
            *("--llm-rounds", str(self.rounds)),
        ]


def llm_config(
    out: str, size: LlmSize, name: str, threads: int = 1, parallel: str = "1"
) -> dict[str, Any]:
    """FedIT on SmolLM2; dropout 0 so that both sides train the same numbers without RNG."""
    return {
        "name": name,
        "algorithm": "fedavg",
        "rounds": size.rounds,
        "seed": 0,
        "task": {
            "kind": "instruction",
            "model": "smollm2-135m-instruct",
            "autocast_bf16": True,
            "source_options": {"per_domain_train": 20, "per_domain_test": 1},
            "lora": LORA,
            "prompt": {"max_length": 128, "max_prompt_length": 96},
            "pad_to_multiple_of": 32,
            # fedfm evaluates after the last round; the smallest evaluation it allows (one item
            # per domain, one log-likelihood pass) is charged to fedfm, Flower evaluates nothing.
            "max_eval": 1,
            "choice_mode": "loglik",
            "eval_ppl": False,
            "max_new_tokens": 1,
        },
        "partition": {"scheme": "iid", "num_clients": size.clients},
        "clients": {"parallel": parallel if parallel == "auto" else int(parallel)},
        "train": {"steps": size.steps, "batch_size": LLM_BATCH, "optimizer": "adamw", "lr": 5e-4},
        "eval_before": False,
        "out_dir": out,
        "plots": False,
        "threads": threads,
    }


def llm_prepare(out: str, size: LlmSize) -> None:
    """Writes what the Flower side needs: each (round, client)'s token batches, exactly those
    fedfm's clients draw, its example count, and fedfm's initial adapter."""
    import torch

    from fedfm.core.federation import derive_seed
    from fedfm.engine import build

    setup = build(load_config(llm_config(out, size, "prepare")))
    task, seed = setup.task, setup.cfg.seed
    # The initial global adapter is the one fedfm's FedAvg drew when it was built.
    init = {k: v.clone() for k, v in setup.algo.params.items()}  # type: ignore[attr-defined]
    work: dict[str, Any] = {"init": init, "clients": {}}
    for cid in task.client_ids():
        data = task.client_data(cid)
        rounds = {}
        for rnd in range(1, size.rounds + 1):
            it = task.batches(data, LLM_BATCH, derive_seed(seed, rnd, cid, "batches"))
            rounds[rnd] = [next(it) for _ in range(size.steps)]
        work["clients"][cid] = {"n": task.num_examples(data), "batches": rounds}
    torch.save(work, Path(out) / "flower_work.pt")


def flower_lora() -> Any:
    """The peft config of the Flower side (FlowerTune's)."""
    import peft

    return peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
        target_modules=LORA["target_modules"], task_type="CAUSAL_LM",
    )  # fmt: skip


def flower_saved_keys(state: dict[str, Any]) -> dict[str, Any]:
    """Flower's final arrays (keyed by the peft model's parameter names) under peft's saved
    keys, fedfm's one format, mapped by peft itself over a model built on the meta device."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from fedfm.models.causal_lm import causal_lm_config

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(causal_lm_config("smollm2-135m-instruct"))
    model = peft.get_peft_model(base, flower_lora())
    return dict(
        peft.get_peft_model_state_dict(
            model, state_dict=state, adapter_name="default", save_embedding_layers=False
        )
    )


def flowertune_apps(out: str, size: LlmSize) -> tuple[Any, Any]:
    """A FlowerTune-style ServerApp (Flower's FedAvg) and ClientApp (loads the base per call)."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    work_file = Path(out) / "flower_work.pt"
    client_app, server_app = ClientApp(), ServerApp()

    def get_model() -> Any:  # FlowerTune's models.get_model: the base from disk, then peft
        import peft
        from transformers import AutoModelForCausalLM

        from fedfm.models.causal_lm import smollm2_dir

        base = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
        return peft.get_peft_model(base, flower_lora())

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        cid = str(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        model = get_model()
        # FlowerTune's set_parameters: peft places the adapter's saved keys (a load that
        # placed nothing would train from peft's own random initialisation).
        received = msg.content["arrays"].to_torch_state_dict()
        placed = set_peft_model_state_dict(model, received)
        if placed.unexpected_keys:
            raise RuntimeError(f"adapter keys not placed: {placed.unexpected_keys[:3]}")
        client = torch.load(work_file, weights_only=False)["clients"][cid]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
        model.train()
        for batch in client["batches"][rnd][: size.steps]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        # FlowerTune's get_parameters: the adapter under peft's saved keys.
        state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        reply = RecordDict(
            {"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": client["n"]})}
        )
        return Message(content=reply, reply_to=msg)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        init = torch.load(work_file, weights_only=False)["init"]
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=size.clients,
            min_available_nodes=size.clients,
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(init),
            num_rounds=size.rounds,
            train_config=ConfigRecord({}),
        )
        torch.save(result.arrays.to_torch_state_dict(), Path(out) / "flower_final.pt")

    return server_app, client_app


def llm_child(side: str, out: str, size: LlmSize, threads: int, parallel: str) -> None:
    """One side of the LLM case in this fresh process."""
    import torch

    if side == "fedfm":
        cfg = load_config(llm_config(out, size, "fedfm-llm", threads, parallel))
        run(cfg, overwrite=True, progress=False)
        torch.save(final_params(Path(out) / cfg.name), Path(out) / "fedfm_final.pt")
        return
    from flwr.simulation import run_simulation

    from fedfm.runtime.flower.options import flower_env, quiet_flower

    server_app, client_app = flowertune_apps(out, size)
    backend = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False},
    }
    with flower_env():
        quiet_flower(False)
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=size.clients,
            backend_config=backend,  # type: ignore[arg-type]
        )


def side_env(env: dict[str, str]) -> dict[str, str]:
    """fedfm's side runs under the C allocator that ``fedfm run`` would start with (jemalloc
    where installed, on glibc; ``FEDFM_ALLOCATOR``); Flower's under this process's."""
    import platform

    from fedfm.allocator import find_jemalloc, relaunch_env

    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    return relaunch_env(["fedfm", "run"], env, find_jemalloc(), glibc) or env


def allocator_of(env: dict[str, str]) -> str:
    """The allocator a side's environment preloads: jemalloc or the C library's."""
    from fedfm.allocator import preloaded

    return "jemalloc" if preloaded(env) else "system malloc"


def llm_side(
    side: str, out: str, size: LlmSize, threads: int, parallel: str = "1"
) -> tuple[float, int, int]:
    """Runs one side in a fresh process: (wall seconds, peak RSS and peak PSS summed over its
    process tree)."""
    cmd = [sys.executable, __file__, "--llm-child", side, "--out", out, *size.args()]
    cmd += ["--llm-threads", str(threads), "--llm-parallel", parallel]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    if side == "fedfm":
        env = side_env(env)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRss({side: [proc.pid]}, every_s=0.25) as mem:
        _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{side} failed (exit code {proc.returncode})")
    return wall, mem.peak[side], mem.pss[side]


def llm_case(size: LlmSize, threads: int, parallel: str, tolerance: float) -> bool:
    """Both sides of the LLM case; whether their final adapters agree."""
    import torch

    from fedfm.models.causal_lm import smollm2_dir

    smollm2_dir()  # convert once here, so that neither side pays for it
    with tempfile.TemporaryDirectory() as out:
        llm_prepare(out, size)
        emb_wall, emb_rss, emb_mem = llm_side("fedfm", out, size, threads, parallel)
        mine = allocator_of(side_env(dict(os.environ)))
        print(
            f"fedfm embedded ({threads} torch threads, clients.parallel={parallel}, {mine}):"
            f" {emb_wall:.1f} s, peak summed over processes: PSS {emb_mem / 2**30:.2f} GiB,"
            f" RSS {emb_rss / 2**30:.2f} GiB",
            flush=True,
        )
        fl_wall, fl_rss, fl_mem = llm_side("flower", out, size, 1)
        print(
            f"Flower simulation (FlowerTune layout, {os.cpu_count()} Ray actors of 1 thread,"
            f" {allocator_of(dict(os.environ))}):"
            f" {fl_wall:.1f} s, peak summed over processes: PSS {fl_mem / 2**30:.2f} GiB,"
            f" RSS {fl_rss / 2**30:.2f} GiB",
            flush=True,
        )
        ours = torch.load(Path(out) / "fedfm_final.pt")
        theirs = flower_saved_keys(torch.load(Path(out) / "flower_final.pt"))
        same = check_agreement("final global adapters, fedfm vs Flower", ours, theirs, tolerance)
    work = f"FedIT SmolLM2 LoRA, {size.clients} clients x {size.rounds} rounds x {size.steps} steps"
    print(
        f"{work}: ratio flower/fedfm wall time {fl_wall / emb_wall:.2f}, peak memory"
        f" {fl_mem / emb_mem:.2f} (PSS; RSS {fl_rss / emb_rss:.2f}); fedfm/flower wall"
        f" {emb_wall / fl_wall:.2f} (target <= 0.75), peak PSS {emb_mem / fl_mem:.2f}"
        " (target <= 0.5)"
    )
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sim-cpus", type=int, default=None, help="CPUs for Ray (default: all)")
    ap.add_argument("--skip-deploy", action="store_true")
    ap.add_argument("--isolation", default="process", choices=["process", "subprocess"])
    ap.add_argument("--llm", action="store_true", help="the FedIT SmolLM2 case instead")
    ap.add_argument("--llm-steps", type=int, default=4, help="local steps per client and round")
    ap.add_argument("--llm-clients", type=int, default=LLM_CLIENTS, help="clients, all sampled")
    ap.add_argument("--llm-rounds", type=int, default=LLM_ROUNDS, help="rounds")
    ap.add_argument(
        "--llm-parallel", default="auto", help="fedfm's clients.parallel: auto or N (1: none)"
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=LLM_TOLERANCE,
        help="largest |fedfm - Flower| of a final adapter element that agrees",
    )
    ap.add_argument(
        "--llm-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="fedfm's torch threads (default: every core, as many as Flower's Ray actors)",
    )
    ap.add_argument("--llm-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = LlmSize(args.llm_steps, args.llm_clients, args.llm_rounds)
    if args.llm_child is not None:
        llm_child(args.llm_child, args.out, size, args.llm_threads, args.llm_parallel)
        return
    if args.llm:
        if not llm_case(size, args.llm_threads, args.llm_parallel, args.tolerance):
            raise SystemExit("final global adapters of fedfm and Flower differ (line above)")
        return
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
        agree = check_agreement(
            "final global parameters, embedded vs flower-sim",
            final_params(Path(out) / "embedded"),
            final_params(Path(out) / "flower-sim"),
            0.0,
        )
        if not (same and agree):
            raise SystemExit("the embedded and flower-sim runs ended differently (lines above)")
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
