"""Client memory of FedRD vs federated LoRA on the foundation model (target: ratio <= 0.1).

Measures the peak memory of ONE client's local training, each in a fresh process: memory is
sampled every 2 ms, and the increase of the anonymous resident memory (RssAnon) over its value
just before the client's model is built is the training memory (model, received parameters,
optimizer state, activations, gradients); the RSS increase, which adds library code pages
touched on first use, is printed too. A FedRD client holds only the student; a federated-LoRA
client holds all-MiniLM-L6-v2 with LoRA adapters and a head. Prints one line per client, then
the ratio FedRD / LoRA last.

Usage:
    python benchmarks/client_memory.py [--steps N] [--batch-size B] [--repeats K] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedfm.measure import memory_table

# What is compared: a FedRD client holds only the student; a federated-LoRA client holds the
# foundation model (MiniLM) with LoRA adapters and a head.
CLIENTS = {
    "FedRD client (text student)": "fedrd-text",
    "federated LoRA client (MiniLM + LoRA)": "fedrd-text-lora",
    "FedRD client (vision student)": "fedrd-vision",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="local steps (default: presets')")
    ap.add_argument("--batch-size", type=int, default=None, help="local batch size")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per client (median)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    overrides = []
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.batch_size is not None:
        overrides.append(f"train.batch_size={args.batch_size}")
    results = memory_table(
        {label: (preset, overrides) for label, preset in CLIENTS.items()}, repeats=args.repeats
    )
    for label, m in results.items():
        if "error" in m:
            print(f"{label:40s} failed: {m['error']}", flush=True)
            continue
        print(
            f"{label:40s} params {m['params_on_client']:>11,}"
            f"  trainable {m['params_trainable']:>9,}"
            f"  training {m['train_mb']:7.1f} MB [{m['train_mb_min']:.1f}-{m['train_mb_max']:.1f}]"
            f"  RSS +{m['rss_increase_mb']:7.1f} MB  process peak {m['peak_mb']:7.1f} MB",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    fedrd = results["FedRD client (text student)"]["train_mb"]
    lora = results["federated LoRA client (MiniLM + LoRA)"]["train_mb"]
    print(f"client memory ratio FedRD / federated LoRA (training memory): {fedrd / lora:.3f}")


if __name__ == "__main__":
    main()
