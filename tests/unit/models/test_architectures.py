"""Architectures beyond Llama: tiny random Qwen2 and Gemma run FedIT, FedSDR, FedHDS's
features and DP-SGD with ``target_modules: auto`` and their own chat templates."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.config import TrainConfig, load_config
from fedfm.core.dp import DPSGDConfig
from fedfm.core.federation import ClientState
from fedfm.engine import build
from fedfm.fm import Adapters, FoundationModel
from fedfm.models.lora import LoraConfigSpec
from fedfm.runtime import run
from helpers.bases import tiny_task
from helpers.config import make_config

ARCHS = ["tiny-qwen2", "tiny-gemma"]
TINY = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 5}
# What each template writes before the user text, and the token that ends a reply.
OPENING = {
    "tiny-qwen2": ("<|im_start|>user\n", "<|im_end|>"),
    "tiny-gemma": ("<bos><start_of_turn>user\n", "<end_of_turn>"),
}


# One round on a tiny random model of the architecture named by ``task__model``.
ARCH: dict[str, Any] = {
    "rounds": 1,
    "eval_before": False,
    "plots": False,
    "threads": 1,
    "task": tiny_task(
        TINY,
        source_options={
            "per_domain_train": 4,
            "per_domain_test": 2,
            "domains": ["general", "movie"],
        },
        lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "auto"},
        prompt={"max_length": 96, "max_prompt_length": 64},
        max_eval=2,
        max_new_tokens=3,
        eval_ppl=False,
    ),
    "partition": {"scheme": "natural"},
    "train": {"steps": 2, "batch_size": 2, "optimizer": "adamw", "lr": 1e-2},
}


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ARCHS)
def test_a_fedit_round_trains_the_attention_adapters_in_the_models_own_template(
    tmp_path, model
) -> None:
    cfg = load_config(
        make_config(ARCH, tmp_path, name="fedit", task__model=model, algorithm="fedavg")
    )
    setup = build(cfg)
    fm = setup.task.foundation_model()
    opening, end = OPENING[model]
    batch = next(setup.task.batches(setup.task.client_data("0"), 2, seed=0))
    text = fm.tokenizer.decode(batch["input_ids"][0])
    assert text.startswith(opening)  # the tokenizer's own chat template, not ChatML for all
    labels = batch["labels"][0]
    assert fm.tokenizer.decode(labels[labels != -100][-1:]) == end
    run(cfg, progress=False)
    row = _rows(tmp_path / "fedit")[-1]
    assert math.isfinite(row["train_loss"]) and row["failed"] == 0
    adapter = fm.get_adapter("default")
    # auto: peft's defaults for the architecture, q_proj and v_proj of every layer.
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj"}
    assert len(adapter) == 2 * 2 * TINY["layers"]
    sent = sum(v.numel() * v.element_size() for v in adapter.values())
    assert row["bytes_up_arrays"] == 2 * sent  # two clients, the adapter only


def test_all_linear_dora_adapters_train_on_qwen2(tmp_path) -> None:
    lora = {"target_modules": "all-linear", "use_dora": True}
    cfg = load_config(
        make_config(
            ARCH,
            tmp_path,
            name="dora",
            task__model="tiny-qwen2",
            algorithm="fedavg",
            task={"lora": {"r": 2, **lora}},
        )
    )
    run(cfg, progress=False)
    row = _rows(tmp_path / "dora")[-1]
    assert math.isfinite(row["train_loss"])
    adapter = build(cfg).task.foundation_model().get_adapter("default")
    layers = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert any("lora_magnitude_vector" in k for k in adapter)  # DoRA's magnitudes travel too


@pytest.mark.parametrize("model", ARCHS)
def test_a_fedsdr_round(tmp_path, model) -> None:
    algo = {
        "fedsd": {"decoding": {"max_new_tokens": 4}, "cache_dir": str(tmp_path / "cache")},
        "steps_s": 1,
        "steps_r": 1,
    }
    prompt = {"max_length": 160, "max_prompt_length": 128}  # room for the rewrite template
    run(
        load_config(
            make_config(
                ARCH,
                tmp_path,
                name="sdr",
                task__model=model,
                algorithm="fedsdr",
                algo=algo,
                task={"prompt": prompt},
            )
        ),
        progress=False,
    )
    rows = _rows(tmp_path / "sdr")
    assert rows[-1]["round"] == 1 and rows[-1]["failed"] == 0
    assert math.isfinite(rows[-1]["train_loss"])


@pytest.mark.parametrize("model", ARCHS)
def test_fedhds_features_are_every_layer_of_the_last_token(tmp_path, model) -> None:
    cfg = load_config(
        make_config(
            ARCH,
            tmp_path,
            name="hds",
            task__model=model,
            algorithm="fedhds",
            algo={"min_cluster_size": 2},
        )
    )
    features: Any = build(cfg).algo.features
    data = features.task.client_data("0")
    _, tokens = features.usable("0", data)
    feats = features.fm.features(tokens, ["global"])
    assert feats.shape == (len(tokens), TINY["layers"] + 1, TINY["hidden"])
    assert bool(torch.isfinite(feats).all())
    one = torch.cat([features.fm.features([t], ["global"], batch_size=1) for t in tokens])
    assert torch.allclose(feats, one, atol=1e-5)  # padding does not leak into the features


@pytest.mark.parametrize("model", ARCHS)
def test_a_dp_sgd_step_on_the_adapter(model) -> None:
    fm = FoundationModel(model, args={**TINY, "seed": 11}, lora=LoraConfigSpec(r=2, alpha=4))
    fm.add_adapter("private", seed=1)
    rows = fm.encode(
        [
            {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
            {"instruction": "Add 2 and 3.", "input": "", "output": "2 + 3 = 5"},
        ]
    )
    before = fm.get_adapter("private")
    res, trained = fm.dp_train(
        rows,
        ClientState(),
        Adapters(["private"], ["private"]),
        train=TrainConfig(optimizer="sgd", lr=0.5, batch_size=2),
        dp=DPSGDConfig(noise_multiplier=1.0, max_grad_norm=0.1),
        delta=1e-5,
        steps=1,
        planned_steps=1,
        seed=0,
    )
    after = fm.get_adapter("private")
    assert list(trained) == list(after) and all(torch.equal(trained[k], after[k]) for k in after)
    assert res.steps == 1 and math.isfinite(res.epsilon) and res.epsilon > 0
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(bool(torch.isfinite(v).all()) for v in after.values())
    assert fm.active == [] and fm.trainable == []  # the shared model is left as it was
