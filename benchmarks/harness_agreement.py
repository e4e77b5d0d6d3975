"""``fedfm eval``'s numbers against fedfm's own scorer, on a run that ``fedfm eval`` has scored.

Reads ``RUN/lm_eval.json`` (written by ``fedfm eval RUN --tasks fedfm_trec20 --include
tests/lm_eval_tasks``), scores the same documents with fedfm's scorer and the run's adapter
(:func:`fedfm.harness.fedfm_choice_scores`), and prints both accuracies and the largest
difference between the two log-likelihoods of a choice once each document's shared term (the
prompt's trailing newline, which the harness moves into every continuation) is removed.

Both score under the autocast ``fedfm eval`` used (``lm_eval.json``'s ``autocast_bf16``; a run
scored with ``--float32`` is compared in float32).

Usage: .venv/bin/python benchmarks/harness_agreement.py RUN [--task fedfm_trec20]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedfm.harness import fedfm_choice_scores

TASKS = Path(__file__).resolve().parent.parent / "tests" / "lm_eval_tasks"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--task", default="fedfm_trec20")
    args = ap.parse_args()
    saved = json.loads((args.run / "lm_eval.json").read_text())
    samples = sorted(saved["samples"][args.task], key=lambda s: s["doc_id"])
    docs = [json.loads(x) for x in (TASKS / "trec20.jsonl").read_text().splitlines()]
    docs = docs[: len(samples)]
    autocast = bool(saved.get("autocast_bf16", True))
    acc, ours = fedfm_choice_scores(args.run, docs, autocast=autocast)
    deviation = max(
        abs((s["logliks"][i] - s["logliks"][0]) - (a[i] - a[0]))
        for a, s in zip(ours, samples, strict=True)
        for i in range(len(a))
    )
    print(
        f"{args.task}: lm-eval acc {saved['results'][args.task]['acc']:.4f},"
        f" fedfm acc {acc:.4f} on {len(docs)} documents"
    )
    print(f"largest log-likelihood difference after each document's shared term: {deviation:.2e}")


if __name__ == "__main__":
    main()
