"""Bases of the test configs, one per family of tests (pass one to ``helpers.config.build``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_task(model_args: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """An instruction task on a tiny random ``tiny-llama`` (``model_args``), LoRA r 4 on its
    attention, and ``changes`` (source options, prompt budget, evaluation)."""
    task = {"kind": "instruction", "model": "tiny-llama", "model_args": model_args}
    return {**task, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, **changes}


DPSYN_DELTA = 1e-3
# dpsyn on rotten tomatoes with a one-layer tiny Llama: profile, one DP-SGD round, generation,
# voting in seconds.
DPSYN: dict[str, Any] = {
    "name": "dpsyn",
    "rounds": 3,
    "algorithm": "dpsyn",
    "plots": False,
    "eval_before": False,
    "algo": {
        "train_rounds": 1,
        "epsilon_train": 8,
        "epsilon_profile": 1,
        "epsilon_vote": 2,
        "num_samples": 16,
        "embedder": "hashed-ngrams",
        "k": 2,
        "generation": {"do_sample": True, "top_p": 0.9, "max_new_tokens": 6, "batch_size": 8},
        "eval": {"clf_steps": 10, "floor": True},
    },
    "task": {
        "kind": "control_text",
        "dataset": "rotten_tomatoes",
        "max_train": 160,
        "max_test": 30,
        "local_test_fraction": 0,
        "lm": "tiny-llama",
        "lm_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 31},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "prompt": {"max_length": 48, "max_prompt_length": 24},
    },
    "partition": {"scheme": "iid", "num_clients": 4},
    "clients": {"roles": {"strong": 0.5}},
    "train": {"steps": 2, "batch_size": 8, "optimizer": "adamw", "lr": 1e-2},
    # Seeded noise: the tests below compare runs of the same seed bit for bit.
    "privacy": {"delta": DPSYN_DELTA, "noise": "seeded"},
}


DOMAINS3 = ["general", "math", "movie"]

# FedSDR / FedSD / FedIT on a one-layer tiny Llama over three instruction domains (one client
# each: a natural partition). Set ``name``, ``algorithm`` and ``algo``.
FEDSDR: dict[str, Any] = {
    "rounds": 2,
    "eval_before": False,
    "plots": False,
    "threads": 1,
    "task": tiny_task(
        {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 8},
        source_options={"per_domain_train": 4, "per_domain_test": 2, "domains": DOMAINS3},
        prompt={"max_length": 160, "max_prompt_length": 128},
        max_new_tokens=4,
        eval_ppl=False,
    ),
    "partition": {"scheme": "natural"},
    "train": {"steps": 2, "batch_size": 4, "optimizer": "adamw", "lr": 1e-2},
}


def fedsdr_algo(cache: Path, **extra: Any) -> dict[str, Any]:
    """FedSDR's ``algo`` section for the tiny runs: short rewrites cached in ``cache``."""
    return {
        "fedsd": {"decoding": {"max_new_tokens": 8}, "cache_dir": str(cache)},
        "steps_s": 2,
        "steps_r": 2,
        **extra,
    }


# FedIT over LoRA on a one-layer tiny Llama, three instruction domains (a natural partition),
# perplexity on: the instruction task's and its evaluator's tests.
INSTRUCTION: dict[str, Any] = {
    "name": "lm",
    "rounds": 2,
    "algorithm": "fedavg",
    "task": tiny_task(
        {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 0},
        source_options={
            "per_domain_train": 12,
            "per_domain_test": 4,
            "domains": ["general", "movie", "spam"],
        },
        prompt={"max_length": 80, "max_prompt_length": 48},
        max_eval=6,
        max_new_tokens=3,
        eval_batch_size=8,
        eval_ppl=True,
    ),
    "plots": False,
    "train": {"steps": 2, "batch_size": 4, "optimizer": "adamw", "lr": 1e-3},
}


# FedRD on sklearn's 8x8 digits: a small CNN student, four Dirichlet clients, the tiny
# teacher ``test-tiny-fm`` of ``helpers.fedrd``. Set ``name`` and ``algorithm``.
FEDRD: dict[str, Any] = {
    "rounds": 2,
    "plots": False,
    "threads": 1,
    "algo": {
        "teacher": "test-tiny-fm",
        "public_size": 100,
        "server_train": {"steps": 3, "batch_size": 32, "optimizer": "adam", "lr": 0.01},
    },
    "task": {
        "kind": "image",
        "dataset": "digits",
        "model": "small-cnn",
        "model_args": {"width": 4, "hidden": 16},
        "max_train": 1000,
    },
    "partition": {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 4, "min_size": 10},
    "train": {"steps": 3, "batch_size": 16, "lr": 0.05},
}
