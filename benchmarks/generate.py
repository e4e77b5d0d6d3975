"""Generation throughput of fedfm's FoundationModel.generate against a bare ``model.generate``.

Both sides decode greedily on SmolLM2-135M-Instruct with one LoRA adapter active (r=8 on
q,k,v,o; the same shared PeftModel object), on the same instruction prompts, the same batches
and the same number of new tokens, in the same process:

* fedfm: :meth:`fedfm.fm.FoundationModel.generate` (adapter switching, length sorting, manual
  left padding, stop-token handling, seeded RNG fork, decoding);
* bare: ``tokenizer(..., padding_side="left")`` and ``model.generate`` under
  ``torch.inference_mode`` on the same batches, decoding each row up to its stop token.

Prompts are sorted by length beforehand, so both sides see identical batches and produce
identical tokens (checked); new tokens count each row's tokens up to and including its stop
token. Repeats alternate the order of the sides; the median of the paired ratios
fedfm/bare of new tokens per second is printed last (target >= 0.95).

Usage: .venv/bin/python benchmarks/generate.py [--repeats 3] [--prompts 16] [--batch 8]
    [--new-tokens 32] [--threads 1] [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedfm.data.prompt import stop_token_ids
from fedfm.data.sources import load_source
from fedfm.fm import FoundationModel
from fedfm.models.generation import pad_id_of
from fedfm.models.lora import LoraConfigSpec


def bare_generate(
    fm: FoundationModel, prompts: list[str], batch: int, new_tokens: int
) -> tuple[list[str], int, float]:
    """Plain transformers generation; returns texts, new tokens and seconds."""
    tok, model = fm.tokenizer, fm.model
    stops, pad = stop_token_ids(tok, fm.prompt_cfg), pad_id_of(tok)
    texts, count = [], 0
    t0 = time.perf_counter()
    with torch.inference_mode(), fm.autocast():
        for start in range(0, len(prompts), batch):
            enc = tok(
                prompts[start : start + batch],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=pad,
            )
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                cut = next((k for k, t in enumerate(row) if t in stops), len(row))
                count += min(cut + 1, len(row))
                texts.append(tok.decode(row[:cut], skip_special_tokens=True).strip())
    return texts, count, time.perf_counter() - t0


def fedfm_generate(
    fm: FoundationModel, prompts: list[str], batch: int, new_tokens: int
) -> tuple[list[str], float]:
    """fedfm's generation as every algorithm calls it; returns texts and seconds."""
    t0 = time.perf_counter()
    texts = fm.generate(prompts, ["global"], seed=0, max_new_tokens=new_tokens, batch_size=batch)
    return texts, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fm = FoundationModel("smollm2-135m-instruct", lora=LoraConfigSpec(), autocast_bf16=args.bf16)
    fm.ensure_adapter("global", seed=0)
    rows = load_source("instruct_suite", per_domain_train=8, per_domain_test=1).train
    rows = rows.shuffle(seed=0).select(range(min(args.prompts, len(rows))))  # every domain
    pairs = zip(rows["instruction"], rows["input"], strict=True)
    prompts = sorted(
        (fm.instruction_prompt(i, x) for i, x in pairs),
        key=lambda p: len(fm.tokenizer(p).input_ids),
    )
    # Warm-up of both sides (first-call allocations), on one batch.
    fedfm_generate(fm, prompts[: args.batch], args.batch, 4)
    with fm.use(["global"]):
        bare_generate(fm, prompts[: args.batch], args.batch, 4)
    ratios, rates = [], {"fedfm": [], "bare": []}
    for rep in range(args.repeats):
        order = ("fedfm", "bare") if rep % 2 == 0 else ("bare", "fedfm")
        secs = {}
        for side in order:
            if side == "fedfm":
                ours, secs["fedfm"] = fedfm_generate(fm, prompts, args.batch, args.new_tokens)
            else:
                with fm.use(["global"]):
                    theirs, tokens, secs["bare"] = bare_generate(
                        fm, prompts, args.batch, args.new_tokens
                    )
        for side in secs:
            rates[side].append(tokens / secs[side])
        ratios.append(rates["fedfm"][-1] / rates["bare"][-1])
        print(
            f"repeat {rep}: {tokens} new tokens  fedfm {rates['fedfm'][-1]:.1f} tok/s  "
            f"bare {rates['bare'][-1]:.1f} tok/s  identical texts: {ours == theirs}",
            flush=True,
        )
    mode = "bf16 autocast" if args.bf16 else "fp32"
    print(
        f"SmolLM2-135M + LoRA r=8, greedy, {len(prompts)} prompts, batch {args.batch}, "
        f"{args.new_tokens} new tokens, {args.repeats} repeats, {mode}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"median new tokens/s: fedfm {statistics.median(rates['fedfm']):.1f}, "
        f"bare {statistics.median(rates['bare']):.1f}"
    )
    ratio = statistics.median(ratios)
    print(f"ratio new tokens/s fedfm/bare (median of paired repeats): {ratio:.3f}")


if __name__ == "__main__":
    main()
