"""The instruction task: data, response-only batches, FedIT over LoRA, per-domain evaluation."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fedfm.tasks.lm as lm
from fedfm.config import load_config
from fedfm.core.train import local_train
from fedfm.data.prompt import IGNORE_INDEX
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.eval.llm import lm_nll
from fedfm.runtime import run
from helpers.bases import INSTRUCTION
from helpers.config import make_config
from helpers.grid import flower_run
from helpers.runfiles import jsonl_rows

DOMAINS = INSTRUCTION["task"]["source_options"]["domains"]
TINY = INSTRUCTION["task"]["model_args"]


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> lm.InstructionTask:
    return build(
        load_config(
            make_config(INSTRUCTION, tmp_path_factory.mktemp("t"), task={"heldout_domain": "spam"})
        )
    ).task


def test_natural_partition_by_domain_and_heldout_domain_kept_out(task) -> None:
    assert task.client_ids() == ["0", "1"]  # three domains minus the held-out one
    domains = [sorted(set(task.client_data(c).rows["domain"])) for c in task.client_ids()]
    assert domains == [["general"], ["movie"]]
    assert [len(task.client_data(c)) for c in task.client_ids()] == [12, 12]
    test = task.test_data()
    # max_eval = 6 over the two seen domains: the first three test items of each.
    assert sorted(test.rows["domain"]) == ["general"] * 3 + ["movie"] * 3
    assert list(test.heldout["domain"]) == ["spam"] * 3
    stats = task.stats()
    assert stats["heldout_domain"] == "spam" and stats["heldout_test_size"] == 3
    assert stats["labels"] == ["general", "movie"]


def test_batches_mask_everything_but_the_response(task) -> None:
    data = task.client_data("1")
    batch = next(task.batches(data, 4, seed=0))
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 4
    assert bool((labels[mask == 0] == IGNORE_INDEX).all())  # padding never counts
    tok = task.tokenizer
    outputs = set(data.rows["output"])
    for row_ids, row_labels in zip(ids, labels, strict=True):
        keep = row_labels != IGNORE_INDEX
        first = int(keep.nonzero()[0])
        # Everything before the response (system/user turns, assistant header) is masked...
        assert not bool(keep[:first].any())
        prompt = tok.decode(row_ids[:first])
        assert prompt.endswith("<|im_start|>assistant\n")
        # ...and the labels hold exactly the reference answer and the end-of-turn token.
        response = tok.decode(row_labels[keep])
        assert response.endswith("<|im_end|>")
        assert response.removesuffix("<|im_end|>") in outputs
    again = next(task.batches(data, 4, seed=0))
    assert torch.equal(again["input_ids"], ids)  # seeded
    other = next(task.batches(data, 4, seed=1))
    assert not torch.equal(other["input_ids"], ids) or other["input_ids"].shape != ids.shape


def test_build_model_is_shared_base_with_fresh_adapter_equal_to_base(task) -> None:
    model = task.build_model(seed=3)
    assert model is task.build_model(seed=3)  # one PeftModel per process
    assert model is task.foundation_model().model  # the handle's
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    # Same seed, same A; B starts at zero, so the adapted model equals the base.
    first = task.get_params(model)
    again = task.get_params(task.build_model(seed=3))
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = task.get_params(task.build_model(seed=4))
    assert any(not torch.equal(first[k], other[k]) for k in first if "lora_A" in k)
    assert all(float(v.abs().sum()) == 0.0 for k, v in other.items() if "lora_B" in k)
    ids = torch.tensor([[1, 50, 60, 70, 2]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.equal(adapted, base)


def test_what_travels_is_the_adapter_in_peft_saved_keys(task, tmp_path) -> None:
    fm = task.foundation_model()
    model = task.build_model(seed=5)
    sent = task.get_params(model)
    # Exactly the trainable adapter, keyed as peft saves it (the adapter not named) ...
    assert list(sent) == list(fm.get_adapter(lm.ADAPTER))
    assert all(".default." not in k and k.startswith("base_model.model.") for k in sent)
    assert sum(v.numel() for v in sent.values()) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    # ... so it loads into any adapter of this shape, and into plain peft from disk.
    fm.reset_adapter("elsewhere", seed=1)
    fm.set_adapter("elsewhere", sent)
    assert all(torch.equal(v, sent[k]) for k, v in fm.get_adapter("elsewhere").items())
    task.set_params(model, {k: v + 1 for k, v in sent.items()})
    assert all(torch.equal(v, sent[k] + 1) for k, v in task.get_params(model).items())
    assert task.save_adapter(model, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(saved) == set(sent) and all(torch.equal(saved[k], sent[k] + 1) for k in sent)
    # Every key that travels finds its trainable parameter by name (FedProx, SCAFFOLD).
    params = dict(model.named_parameters())
    names = task.param_names(model)
    assert set(names) == set(sent) and all(params[n].requires_grad for n in names.values())
    fm.delete_adapter("elsewhere")


def test_loss_decreases_when_training_on_a_small_set(task) -> None:
    # The tiny base's frozen head caps its logits near 0.6, so the adapter needs the head too.
    model = task.build_model(seed=0, lora={"target_modules": ["q_proj", "v_proj", "lm_head"]})
    data = lm.InstructionData(task.client_data("1").rows.select(range(4)))
    before, n = lm_nll(model, task.tokenizer, data.rows, task.cfg.prompt)
    cfg = load_config({}).train.model_copy(update={"optimizer": "adamw", "lr": 2e-2})
    torch.manual_seed(0)
    res = local_train(model, task.batches(data, 4, seed=0), task.loss, cfg, steps=15)
    after, n2 = lm_nll(model, task.tokenizer, data.rows, task.cfg.prompt)
    assert n == n2 > 0
    assert after / n < 0.5 * (before / n), (before / n, after / n, res.loss)


def test_evaluate_reports_each_domain_and_the_zero_shot_domain(task) -> None:
    out = task.evaluate(task.build_model(seed=0), task.test_data())
    for key in ("score", "acc", "rougeL", "ppl", "n", "zeroshot/score", "zeroshot/acc"):
        assert key in out, key
    for domain in ("general", "movie"):
        assert out[f"n/{domain}"] == 3.0
        assert 0.0 <= out[f"score/{domain}"] <= 1.0
    assert out["score"] == pytest.approx((out["score/general"] + out["score/movie"]) / 2)
    assert out["zeroshot/n"] == 3.0
    # The held-out domain is scored per domain like the rest, under zeroshot/.
    assert out["zeroshot/score/spam"] == out["zeroshot/score"]
    assert out["zeroshot/n/spam"] == 3.0
    assert {"zeroshot/pred/spam/ham", "zeroshot/majority/spam", "zeroshot/uniform/spam"} <= set(out)
    assert out["zeroshot/pred/spam/ham"] + out["zeroshot/pred/spam/spam"] <= 1.0
    assert "score/spam" not in out  # never among the seen domains
    assert task.evaluate(task.build_model(seed=0), task.client_test_data("0")) == {}


def test_likelihood_only_scores_labels_references_and_held_out_text(tmp_path, monkeypatch) -> None:
    def no_generation(*args: Any, **kw: Any) -> None:
        raise AssertionError("likelihood_only generated")

    monkeypatch.setattr("fedfm.eval.llm.generate_replies", no_generation)
    section = {
        "heldout_domain": "spam",
        "choice_mode": "loglik",
        "likelihood_only": True,
        "text_nll": {"corpus": "c4_demo", "docs": 5, "max_tokens": 16},
        "primary": "zeroshot/score",
    }
    task = build(load_config(make_config(INSTRUCTION, tmp_path, task=section))).task
    out, items = task.evaluate_items(task.build_model(seed=0), task.test_data())
    by = {d: [it for it in items if it["domain"] == d] for d in ("general", "movie", "c4_demo")}
    # General is not generated: no score, its references' NLL per item.
    assert {it["metric"] for it in by["general"]} == {"nll"} and "score/general" not in out
    assert all(it["score"] is None and it["nll_tokens"] > 0 for it in by["general"])
    assert out["score"] == out["score/movie"] and "zeroshot/acc/spam" in out
    # The documents: per-token NLL over every scored token, one item each, ids of their own.
    docs = by["c4_demo"]
    assert [it["id"] for it in docs] == [f"c4_demo/{i}" for i in range(5)]
    assert all(it["nll_tokens"] == 15 and it["score"] is None for it in docs)
    nll = sum(it["nll"] for it in docs) / sum(it["nll_tokens"] for it in docs)
    assert out["text_nll/c4_demo"] == pytest.approx(nll)
    assert out["text_docs/c4_demo"] == 5 and out["text_tokens/c4_demo"] == 75
    # Top-1 token accuracy beside it: the documents' hits over every scored token.
    hits = sum(it["top1"] for it in docs)
    assert all(0 <= it["top1"] <= it["nll_tokens"] for it in docs)
    assert out["text_top1/c4_demo"] == pytest.approx(hits / 75)
    assert task.stats()["text_docs"] == 5
    # A client's local split holds no documents.
    local = task.evaluate(task.build_model(seed=0), task.client_test_data("0"))
    assert "text_nll/c4_demo" not in local


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"likelihood_only": True}, "likelihood_only"),  # choice_mode generate
        ({"likelihood_only": True, "choice_mode": "loglik", "eval_ppl": False}, "likelihood_only"),
        ({"text_nll": {"corpus": "poetry"}}, r"task\.text_nll\.corpus"),
        ({"text_nll": {"corpus": "alpaca_demo"}}, "not plain text"),
        ({"text_nll": {"docs": 301}}, r"task\.text_nll\.docs"),
        ({"text_nll": {"max_tokens": 1}}, "max_tokens"),
        (
            {"likelihood_only": True, "choice_mode": "loglik", "primary": "rougeL"},
            r"task\.primary",
        ),
    ],
)
def test_bad_likelihood_settings_name_the_field(tmp_path, section, field) -> None:
    with pytest.raises(ConfigError, match=field):
        build(load_config(make_config(INSTRUCTION, tmp_path, task=section)))


def test_fedavg_over_lora_sends_only_adapter_tensors(tmp_path) -> None:
    cfg = load_config(make_config(INSTRUCTION, tmp_path, name="fedit"))
    summary = run(cfg, progress=False)
    task = build(cfg).task
    model = task.build_model(seed=0)
    adapter = task.get_params(model)
    n_tensors = len(adapter)
    n_numel = sum(v.numel() for v in adapter.values())
    n_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert n_bytes == sum(p.numel() * p.element_size() for p in trainable)
    rows = [r for r in jsonl_rows(tmp_path / "fedit" / "audit.jsonl") if r["type"] == "arrays"]
    assert {(r["round"], r["direction"]) for r in rows} == {
        (1, "down"),
        (1, "up"),
        (2, "down"),
        (2, "up"),
    }
    for r in rows:  # each message carries the adapter, nothing of the 1-layer base
        assert (r["field"], r["tensors"], r["numel"], r["bytes"]) == (
            "params",
            n_tensors,
            n_numel,
            n_bytes,
        )
    assert len(rows) == 2 * 2 * 3  # rounds x directions x clients (one per domain)
    metrics = jsonl_rows(tmp_path / "fedit" / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert "score/general" in metrics[0] and "train_loss" in metrics[1]
    assert summary["primary"] == "score"


def test_fedit_server_params_are_the_adapter_keys(tmp_path) -> None:
    setup = build(
        load_config(
            make_config(INSTRUCTION, tmp_path, algo={"server_opt": {"name": "fedadam", "lr": 0.01}})
        )
    )
    fm = setup.task.foundation_model()
    assert list(setup.algo.params) == list(fm.get_adapter(lm.ADAPTER))


@pytest.mark.parametrize(
    ("algorithm", "algo"),
    [("fedprox", {"mu": 0.1}), ("scaffold", {}), ("fedavg", {"server_opt": {"name": "fedyogi"}})],
)
def test_other_fedavg_family_members_run_on_lora(tmp_path, algorithm, algo) -> None:
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            name=algorithm,
            rounds=1,
            algorithm=algorithm,
            algo=algo,
            eval_before=False,
            partition={"scheme": "dirichlet", "num_clients": 2, "alpha": 1.0, "min_size": 3},
        )
    )
    run(cfg, progress=False)
    rows = jsonl_rows(tmp_path / algorithm / "metrics.jsonl")
    assert rows[-1]["failed"] == 0 and rows[-1]["clients"] == 2
    assert rows[-1]["train_loss"] > 0 and "score" in rows[-1]


def test_bfloat16_base_keeps_a_float32_adapter_and_trains_under_autocast(tmp_path) -> None:
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            name="bf16",
            rounds=1,
            eval_before=False,
            task={"dtype": "bfloat16", "autocast_bf16": True, "model_args": {**TINY, "seed": 1}},
        )
    )
    task = build(cfg).task
    model = task.build_model(seed=0)
    base_dtypes = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert base_dtypes == {torch.bfloat16}
    assert {v.dtype for v in task.get_params(model).values()} == {torch.float32}  # what travels
    run(cfg, progress=False)
    rows = jsonl_rows(tmp_path / "bf16" / "metrics.jsonl")
    assert rows[-1]["failed"] == 0 and rows[-1]["train_loss"] > 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert rows[-1]["bytes_down"] == 3 * sum(p.numel() * p.element_size() for p in trainable)


def test_local_alpaca_file_without_domains_or_metrics(tmp_path) -> None:
    rows = [
        {"instruction": f"Repeat the number {i}.", "input": "", "output": f"{i}"} for i in range(20)
    ]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(rows))
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            task={"dataset": "hf", "source_options": {"path": str(path)}, "test_fraction": 0.2},
            partition={"scheme": "iid", "num_clients": 2},
        )
    )
    task = build(cfg).task
    assert [len(task.client_data(c)) for c in task.client_ids()] == [8, 8]
    test = task.test_data().rows
    assert len(test) == 4 and set(test["metric"]) == {"rouge"}
    out = task.evaluate(task.build_model(seed=0), task.test_data())
    assert {"score", "rougeL", "score/general", "ppl"} <= set(out)


def test_bad_config_values_name_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"task\.heldout_domain"):
        build(load_config(make_config(INSTRUCTION, tmp_path, task={"heldout_domain": "poetry"})))
    with pytest.raises(ConfigError, match=r"task\.dataset"):
        build(
            load_config(
                make_config(
                    INSTRUCTION, tmp_path, task={"dataset": "breast_cancer", "source_options": {}}
                )
            )
        )
    with pytest.raises(ConfigError, match=r"task\.choice_mode"):
        build(load_config(make_config(INSTRUCTION, tmp_path, task={"choice_mode": "vote"})))
    with pytest.raises(ConfigError, match=r"partition\.num_clients"):
        build(
            load_config(make_config(INSTRUCTION, tmp_path, partition={"num_clients": 5}))
        )  # natural: 3 domains
    task = build(load_config(make_config(INSTRUCTION, tmp_path))).task
    with pytest.raises(ConfigError, match="overrides"):
        task.build_model(seed=0, hidden=128)


def test_padding_to_a_multiple_leaves_the_loss_unchanged(tmp_path) -> None:
    plain = build(load_config(make_config(INSTRUCTION, tmp_path))).task
    padded = build(
        load_config(make_config(INSTRUCTION, tmp_path, task={"pad_to_multiple_of": 32}))
    ).task
    data = plain.client_data(plain.client_ids()[0])
    a = next(plain.batches(data, 4, seed=1))
    b = next(padded.batches(padded.client_data(plain.client_ids()[0]), 4, seed=1))
    assert b["input_ids"].shape[1] % 32 == 0 and b["input_ids"].shape[1] >= a["input_ids"].shape[1]
    model = plain.build_model(seed=0)
    with torch.no_grad():
        la, lb = plain.loss(model, a)[0], padded.loss(model, b)[0]
    assert float(la) == pytest.approx(float(lb), rel=1e-5)


def test_presets_load_and_validate() -> None:
    from fedfm.engine import resolve

    for name in ("quickstart", "fedit-fedadam"):
        cfg = load_config(name)
        _, task_cfg = resolve(cfg)
        assert task_cfg.kind == "instruction"
        assert task_cfg.model == "smollm2-135m-instruct"


@pytest.mark.usefixtures("task_identity")
def test_fedit_on_flower_equals_embedded(tmp_path) -> None:
    """FedIT's ServerApp and ClientApps on the in-memory grid (Flower's serde on every record)
    log what the embedded run logs; Flower's Ray engine is checked once, on the toy task."""
    run(load_config(make_config(INSTRUCTION, tmp_path, name="embedded")), progress=False)
    cfg = load_config(make_config(INSTRUCTION, tmp_path, name="flower"))
    clients = len(INSTRUCTION["task"]["source_options"]["domains"])  # natural: one per domain
    flower_run(cfg.model_dump(mode="json"), tmp_path / "nodes", num_partitions=clients)
    embedded = jsonl_rows(tmp_path / "embedded" / "metrics.jsonl")
    flower = jsonl_rows(tmp_path / "flower" / "metrics.jsonl")
    skip = {"time_s"}
    assert [{k: v for k, v in r.items() if k not in skip} for r in flower] == [
        {k: v for k, v in r.items() if k not in skip} for r in embedded
    ]


@pytest.mark.slow
def test_one_fedit_round_on_real_smollm2(tmp_path) -> None:
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            name="smollm2",
            rounds=1,
            eval_before=False,
            task={
                "model": "smollm2-135m-instruct",
                "model_args": {},
                "autocast_bf16": True,
                "source_options": {"per_domain_train": 4, "per_domain_test": 2, "domains": DOMAINS},
                "max_eval": 3,
                "choice_mode": "loglik",
                "eval_ppl": False,
                "max_new_tokens": 8,
            },
            train={"steps": 1, "batch_size": 2, "optimizer": "adamw", "lr": 1e-4},
        )
    )
    run(cfg, progress=False)
    rows = jsonl_rows(tmp_path / "smollm2" / "metrics.jsonl")
    assert rows[-1]["failed"] == 0 and rows[-1]["clients"] == 3
    # r=4 LoRA on q,k,v,o of 30 layers: (576·4 + 4·576) q, o; (576·4 + 4·192) k, v; float32.
    per_layer = 2 * (576 * 4 + 4 * 576) + 2 * (576 * 4 + 4 * 192)
    assert rows[-1]["bytes_down"] == 3 * 30 * per_layer * 4
    assert 0.0 <= rows[-1]["score"] <= 1.0
