"""The text-classification task: splits, public split, batches, metrics, errors, a run."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import fedfm.tasks.text  # noqa: F401  (registers the text task until fedfm.tasks imports it)
from fedfm.config import load_config
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.models.students import PAD_ID
from fedfm.runtime import run
from fedfm.tasks.text import TextConfig, TextData, TextTask, check_disjoint


def _run(**kw: Any):
    return load_config(
        {"partition": {"scheme": "dirichlet", "alpha": 0.5, "num_clients": 4, "min_size": 5}, **kw}
    )


def _task(**cfg: Any) -> TextTask:
    base = {"dataset": "trec", "vocab_size": 1024, "max_train": 600, "max_test": 100}
    return TextTask(TextConfig(**{**base, **cfg}), _run())


def test_splits_are_disjoint_and_cover_the_training_rows() -> None:
    task = _task(public_size=50)
    clients = [task.client_data(c) for c in task.client_ids()]
    local = [task.client_test_data(c) for c in task.client_ids()]
    ids = torch.cat([d.ids for d in clients + local])
    assert len(ids) + len(task.public_data()) == 600
    assert len(set(ids.tolist())) == len(ids)  # no row twice
    assert not set(ids.tolist()) & set(task.public_data().ids.tolist())
    assert not set(ids.tolist()) & set(task.test_data().ids.tolist())
    assert len(task.test_data()) == 100 and task.num_classes == 6
    st = task.stats()
    assert st["public_size"] == 50 and sum(st["sizes"]) == 550
    # deterministic in the seed
    again = _task(public_size=50)
    assert torch.equal(again.client_data("0").ids, task.client_data("0").ids)
    assert again.public_data().texts == task.public_data().texts


def test_hashed_batches_loss_and_metrics() -> None:
    task = _task()
    model = task.build_model(seed=0, embed_dim=8, hidden=8)
    x, y = next(task.batches(task.client_data("0"), 8, seed=1))
    assert x.dtype == torch.long and x.shape[0] == 8 and y.shape == (8,)
    data = task.client_data("0")
    first = data.subset([0])
    assert (first.inputs([0])[0] != PAD_ID).sum() == min(len(first.bags[0]), 512)
    loss, out = task.loss(model, (x, y))
    assert out.shape == (8, 6) and loss.item() > 0
    m = task.evaluate(model, task.test_data())
    assert set(m) == {"acc", "macro_f1", "loss"} and 0 <= m["acc"] <= 1
    # hand check of accuracy and macro-F1 with a model that always says class 0
    zero = TextData(["a", "b", "c", "d"], torch.tensor([0, 0, 1, 2]), torch.arange(4))

    class Always0(torch.nn.Module):
        def forward(self, texts: list[str]) -> torch.Tensor:
            return torch.tensor([[1.0, 0, 0, 0, 0, 0]]).repeat(len(texts), 1)

    got = task.evaluate(Always0(), zero)
    # acc 2/4; F1: class 0 has P = 1/2, R = 1 -> 2/3; classes 1, 2 have 0; 3..5 absent
    assert got["acc"] == pytest.approx(0.5)
    assert got["macro_f1"] == pytest.approx((2 / 3) / 3)


def test_empty_text_gets_padding_only() -> None:
    task = _task()
    data = task.to_data({"text": ["", "what is it"], "label": [0, 1], "id": [7, 8]})
    x = data.inputs([0, 1])
    assert x.shape[0] == 2 and int((x[0] != PAD_ID).sum()) == 0
    model = task.build_model(seed=0, embed_dim=4, hidden=4)
    assert torch.isfinite(model(x)).all()


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"task.dataset.*not text"):
        TextTask(TextConfig(dataset="digits"), _run())
    with pytest.raises(ConfigError, match=r"task\.public_size"):
        _task(public_size=600)
    task = _task()
    with pytest.raises(ConfigError, match="vocab_size"):
        task.build_model(vocab_size=99)
    with pytest.raises(ConfigError, match="overlaps client data: 2 shared"):
        check_disjoint(torch.tensor([1, 5, 9]), torch.tensor([9, 2, 1]), "task.public_size")


def test_drug_reviews_keeps_its_own_test_split() -> None:
    task = TextTask(TextConfig(dataset="drug_reviews", vocab_size=1024), _run())
    assert len(task.test_data()) == 379 and task.num_classes == 3
    assert sum(task.stats()["sizes"]) == 600


def test_fedavg_runs_on_the_text_task(tmp_path: Any) -> None:
    cfg = load_config(
        {
            "name": "text-fedavg",
            "algorithm": "fedavg",
            "rounds": 2,
            "out_dir": str(tmp_path),
            "plots": False,
            "task": {
                "kind": "text",
                "dataset": "trec",
                "vocab_size": 2048,
                "max_train": 800,
                "max_test": 200,
                "model_args": {"embed_dim": 16, "hidden": 16},
            },
            "partition": {"scheme": "iid", "num_clients": 3},
            "train": {"steps": 20, "batch_size": 16, "lr": 0.5, "momentum": 0.9},
        }
    )
    assert isinstance(build(cfg).task, TextTask)
    run(cfg, progress=False)
    rows = [
        json.loads(x) for x in (tmp_path / "text-fedavg" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["acc"] > rows[0]["acc"] and "macro_f1" in rows[-1]


@pytest.mark.slow
def test_minilm_lora_classifier_trains_only_adapters_and_head() -> None:
    from fedfm.algorithms.fedavg import FedAvg
    from fedfm.core.groups import get_group
    from fedfm.models.lora import get_adapter_state

    cfg = load_config(
        {
            "algorithm": "fedavg",
            "task": {"kind": "text", "dataset": "trec", "model": "encoder-lora-classifier",
                     "max_train": 200, "max_test": 20},
            "partition": {"scheme": "iid", "num_clients": 2},
            "train": {"steps": 2, "batch_size": 8, "lr": 0.1},
        }
    )  # fmt: skip
    setup = build(cfg)
    algo = setup.algo
    assert isinstance(algo, FedAvg)
    names = set(algo.params)
    # The adapter in peft's saved keys (group "adapter"), the head beside it (group "head").
    assert {k.partition("/")[0] for k in names} == {"adapter", "head"}
    assert {"head/weight", "head/bias"} <= names
    model = algo.model()
    assert model.feature_dim == 384
    peft_model = model.encoder[0].auto_model
    adapter = get_group(algo.params, "adapter")
    assert list(adapter) == list(get_adapter_state(peft_model, "adapter"))  # loads into peft
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(v.numel() for v in algo.params.values())
    frozen_before = {
        k: v.clone()
        for k, v in model.state_dict().items()
        if k.startswith("encoder.") and ".lora_" not in k
    }
    assert len(frozen_before) > 100  # the encoder's weights
    from fedfm.core.federation import ClientContext, ClientState
    from fedfm.core.messages import Message

    ctx = ClientContext("0", "default", 1, 0, setup.task, ClientState())
    reply = setup.client.handlers()["train"](ctx, Message("train", {"params": algo.params}))
    sent = reply.arrays["params"]
    assert set(sent) == names
    assert any(not torch.equal(sent[k], algo.params[k]) for k in names if ".lora_B" in k)
    after = model.state_dict()
    changed = [k for k, v in frozen_before.items() if not torch.equal(after[k], v)]
    assert not changed, changed[:5]
