"""What a set of small seeded runs writes, one per algorithm and option, to diff two versions.

A refactoring must leave behaviour identical. This script runs the test suite's tiny config
of every algorithm (``tests/helpers``: the toy task, tiny Llamas, breast cancer for FedeKD,
the FedRD test teacher) plus the options that change the server step (client-level DP with
seeded noise in both modes, SCAFFOLD under DP, SecAgg+ with and without DP, FedSD on FedAvg,
mixed LoRA ranks, a compressed uplink), each in its own process, and writes what each run
logged into ``OUT/<case>/``: ``metrics.jsonl``, ``audit.jsonl`` and ``privacy.json`` with
their timings (fields named ``*_s``, ``time``, ``wall``) removed, as sorted JSON. Two
versions' outputs are then compared with ``diff -r``.

``--src DIR`` runs the checkout at ``DIR`` (its ``src`` and ``tests``), e.g. an unmodified
worktree, so that before and after come from two folders of one machine.

Usage: .venv/bin/python benchmarks/behaviour.py --src DIR --out OUT [--case NAME ...]
       diff -r OUT_BEFORE OUT_AFTER
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Each case: the Python expression (in the child, with ``out`` the run folder's parent) of
# its config.
ALGORITHMS = (
    "fedavg", "fedprox", "scaffold", "local", "fedekd", "fedkd-ungated", "local-private",
    "fedrd", "fedrd-nophi", "fed-hint", "fedavg-ft", "dpsyn", "fedsdr",
)  # fmt: skip
CASES: dict[str, str] = {
    **{a: f"algorithm_config(out, {a!r})" for a in ALGORITHMS},
    "fedhds": "make_config(FEDHDS, out, name='fedhds')",
    "dp-client": "toy_config(out, 'fedavg', name='dp-client', rounds=3, seed=2,"
    " privacy={'noise': 'seeded', 'user_level': {'clip': 0.5, 'noise_multiplier': 0.7,"
    " 'min_clients': 2}})",
    "dp-server": "toy_config(out, 'fedavg', name='dp-server', rounds=3, seed=2,"
    " privacy={'noise': 'seeded', 'user_level': {'clip': 0.5, 'noise_multiplier': 0.7,"
    " 'min_clients': 2, 'mode': 'server'}})",
    "dp-adaptive": "toy_config(out, 'fedavg', name='dp-adaptive', rounds=3, seed=2,"
    " privacy={'noise': 'seeded', 'user_level': {'clip': 0.5, 'noise_multiplier': 0.3,"
    " 'min_clients': 2, 'adaptive': {}}})",
    "dp-scaffold": "toy_config(out, 'scaffold', name='dp-scaffold', rounds=3, seed=2,"
    " privacy={'noise': 'seeded', 'user_level': {'clip': 0.5, 'noise_multiplier': 0.7,"
    " 'min_clients': 2}})",
    "secagg": "toy_config(out, 'fedavg', name='secagg', rounds=2, seed=2, num_clients=6,"
    " privacy={'secure_aggregation': 'secagg+',"
    " 'secagg': {'num_shares': 5, 'reconstruction_threshold': 3}})",
    "secagg-dp": "toy_config(out, 'fedavg', name='secagg-dp', rounds=2, seed=2, num_clients=6,"
    " privacy={'noise': 'seeded', 'secure_aggregation': 'secagg+',"
    " 'secagg': {'num_shares': 5, 'reconstruction_threshold': 3},"
    " 'user_level': {'clip': 0.5, 'noise_multiplier': 0.7,"
    " 'min_clients': 2}})",
    "fedadam": "toy_config(out, 'fedavg', name='fedadam', rounds=3, seed=2,"
    " algo={'server_opt': {'name': 'fedadam', 'lr': 0.05}})",
    "uplink-int8": "toy_config(out, 'fedavg', name='uplink-int8', rounds=2, seed=2,"
    " comm={'uplink': 'int8', 'downlink': 'bfloat16'})",
    "fedit": "make_config(FEDSDR, out, name='fedit', algorithm='fedavg', rounds=2)",
    "fedit-svd": "lora(make_config(FEDSDR, out, name='fedit-svd', algorithm='fedavg', rounds=1,"
    " algo={'server_opt': {'name': 'fedadam', 'lr': 0.01}}),"
    " client_ranks=[1, 2, 4], rank_mode='svd')",
    "fedit-flora": "lora(make_config(FEDSDR, out, name='fedit-flora', algorithm='fedavg',"
    " rounds=1), r=8, client_ranks=[1, 2, 4], rank_mode='flora')",
    "fedit-ffa": "lora(make_config(FEDSDR, out, name='fedit-ffa', algorithm='fedavg',"
    " rounds=2), freeze_a=True)",
    "fedsd": "make_config(FEDSDR, out, name='fedsd', algorithm='fedavg', rounds=1,"
    " algo={'fedsd': {'enabled': True, 'decoding': {'max_new_tokens': 8},"
    " 'cache_dir': str(out / 'cache')}})",
}

CHILD = """
import sys
sys.path[:0] = [{src!r}, {tests!r}]
from pathlib import Path
import helpers.flower
from helpers.flower import algorithm_config
from helpers.bases import FEDSDR
from helpers.config import make_config, toy_config
from helpers.bases import tiny_task

# The FedHDS unit tests' setting: a two-layer tiny Llama, six IID clients.
FEDHDS = {{
    "algorithm": "fedhds", "rounds": 2, "eval_before": False, "plots": False, "threads": 1,
    "algo": {{"min_cluster_size": 2, "min_samples": 1, "server_min_samples": 1}},
    "task": tiny_task(
        {{"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 8}},
        source_options={{"per_domain_train": 8, "per_domain_test": 2}},
        prompt={{"max_length": 96, "max_prompt_length": 64}},
        max_eval=6, max_new_tokens=4, eval_ppl=False,
    ),
    "partition": {{"scheme": "iid", "num_clients": 6}},
    "train": {{"epochs": 1, "batch_size": 4, "optimizer": "adamw", "lr": 1e-2}},
}}
from fedfm.config import load_config
from fedfm.runtime import run


def lora(cfg, **kw):
    cfg["task"]["lora"] = {{**cfg["task"]["lora"], **kw}}
    return cfg


out = Path({out!r})
cfg = {expr}
cfg["plots"] = False
cfg["name"] = {name!r}
cfg["out_dir"] = str(out)
run(load_config(cfg), progress=False)
"""

TIMED = ("time", "wall", "timestamp", "started", "finished", "date", "host", "pid", "version")


def untimed(obj: Any) -> Any:
    """``obj`` without its timings, host facts and absolute paths (what differs between two
    runs of one seed); an audit row of a timing field keeps its row but not its byte count
    (the digits of a duration vary)."""
    if isinstance(obj, dict) and str(obj.get("field", "")).endswith("_s") and "bytes" in obj:
        obj = {k: v for k, v in obj.items() if k != "bytes"}
    if isinstance(obj, dict):
        return {
            k: untimed(v)
            for k, v in obj.items()
            if not (k.endswith("_s") or k in TIMED or k.endswith("_at"))
        }
    if isinstance(obj, list):
        return [untimed(v) for v in obj]
    if isinstance(obj, str) and obj.startswith(("/tmp", tempfile.gettempdir())):
        return "<path>"
    return obj


def normalise(run_dir: Path, dest: Path) -> list[str]:
    """Writes ``run_dir``'s logs, untimed, into ``dest``; the files it found."""
    dest.mkdir(parents=True, exist_ok=True)
    found = []
    for log in ("metrics.jsonl", "audit.jsonl"):
        path = run_dir / log
        if path.exists():
            rows = [untimed(json.loads(x)) for x in path.read_text().splitlines() if x]
            text = "\n".join(json.dumps(r, sort_keys=True) for r in rows)
            (dest / log).write_text(text + "\n")
            found.append(log)
    path = run_dir / "privacy.json"
    if path.exists():
        obj = untimed(json.loads(path.read_text()))
        (dest / "privacy.json").write_text(json.dumps(obj, sort_keys=True, indent=1) + "\n")
        found.append("privacy.json")
    return found


def run_case(root: Path, name: str, out: Path) -> str:
    """Runs one case with ``root``'s sources; a status line."""
    with tempfile.TemporaryDirectory() as tmp:
        script = CHILD.format(
            src=str(root / "src"),
            tests=str(root / "tests"),
            out=tmp,
            expr=CASES[name],
            name=name,
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            env=env,
            capture_output=True,
            text=True,
            cwd=root,
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return f"{name}: FAILED ({tail})"
        found = normalise(Path(tmp) / name, out / name)
        return f"{name}: {', '.join(found)}"


def main() -> None:
    """Parses the arguments and runs the cases."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=HERE.parent, help="checkout to run")
    ap.add_argument("--out", type=Path, required=True, help="folder of the normalised logs")
    ap.add_argument("--case", action="append", help="only these cases (repeatable)")
    args = ap.parse_args()
    unknown = sorted(set(args.case or ()) - set(CASES))
    if unknown:
        sys.exit(f"error: --case: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    for name in args.case or list(CASES):
        print(run_case(args.src.resolve(), name, args.out), flush=True)


if __name__ == "__main__":
    main()
