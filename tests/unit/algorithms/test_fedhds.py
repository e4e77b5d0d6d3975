"""FedHDS and FedHDS-Turbo on a tiny Llama: features, selection, audit, DP, config errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedfm.algorithms.fedhds import FedHDS, FedHDSClient, flatten_features, rouge_all
from fedfm.algorithms.fedhds_selection import (
    cluster,
    inter_client_select,
    privatise,
    release_sensitivity,
)
from fedfm.config import load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientContext, ClientState
from fedfm.core.messages import Message
from fedfm.engine import build, resolve
from fedfm.errors import ConfigError
from fedfm.runtime import run as run_experiment
from helpers.bases import tiny_task
from helpers.config import make_config
from helpers.grid import flower_run
from helpers.runfiles import jsonl_rows

TINY = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 8}
TURBO = {"vocab": "small", "hidden": 16, "layers": 1, "heads": 2, "seed": 3}


# FedHDS on a two-layer tiny Llama, six IID clients. Eight tiny-model points per client have
# no density structure at the official count (min_samples 2 neighbours): at one neighbour
# these rounds select and train.
FEDHDS: dict[str, Any] = {
    "algorithm": "fedhds",
    "rounds": 2,
    "eval_before": False,
    "plots": False,
    "algo": {"min_cluster_size": 2, "min_samples": 1, "server_min_samples": 1},
    "task": tiny_task(
        TINY,
        source_options={"per_domain_train": 8, "per_domain_test": 2},
        prompt={"max_length": 96, "max_prompt_length": 64},
        max_eval=6,
        max_new_tokens=4,
        eval_ppl=False,
    ),
    "partition": {"scheme": "iid", "num_clients": 6},
    "train": {"epochs": 1, "batch_size": 4, "optimizer": "adamw", "lr": 1e-2},
    "threads": 1,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One two-round run of FedHDS, of GlobalSelect and of FedHDS-Turbo."""
    out = tmp_path_factory.mktemp("fedhds")
    variants = {
        "hds": {},
        "global": {"selection": "global"},
        "turbo": {"feature_model": "tiny-llama", "feature_model_args": TURBO},
    }
    for name, algo in variants.items():
        run_experiment(load_config(make_config(FEDHDS, out, name=name, algo=algo)), progress=False)
    return {name: out / name for name in variants}


def _halves(tmp_path: Path, **algo: Any) -> tuple[FedHDS, FedHDSClient]:
    setup = build(load_config(make_config(FEDHDS, tmp_path, name="unit", algo=algo)))
    assert isinstance(setup.algo, FedHDS) and isinstance(setup.client, FedHDSClient)
    return setup.algo, setup.client


def _algo(tmp_path: Path, **algo: Any) -> FedHDS:
    return _halves(tmp_path, **algo)[0]


# ----------------------------------------------------------------------------- features


def test_features_are_every_layer_of_the_last_token(tmp_path: Path) -> None:
    algo = _algo(tmp_path)
    fm = algo.fm
    data = algo.task.client_data("0")
    positions, tokens = algo.features.usable("0", data)
    feats = fm.features(tokens, ["global"])
    assert feats.shape == (len(tokens), fm.num_layers + 1, fm.hidden_size) == (8, 3, 32)
    flat = algo.features.raw_features(data, "0")
    assert flat.shape == (8, 3 * 32) and flat.dtype == np.float64
    assert np.allclose(flat, flatten_features(feats))
    # Hidden state 0 is the embedding of the last token; it does not depend on the adapter.
    emb = fm.bundle.model.get_input_embeddings().weight.detach()
    assert torch.allclose(feats[:, 0], emb[[t[-1] for t in tokens]], atol=1e-6)
    assert positions == list(range(8))


# ----------------------------------------------------------------------------- selection logic


def test_inter_client_selection_keeps_the_centroid_nearest_each_global_centre() -> None:
    # Two symmetric groups: each group's centre is its middle point; one far point is noise.
    pts = np.array([[-1, 0], [20, 20], [1, 0], [20, 19], [0, 0], [20, 21], [-60, 70.0]])
    chosen, labels = inter_client_select(pts, 2)
    assert sorted(chosen) == [1, 4]
    assert labels[6] == -1 and labels[0] == labels[2] == labels[4] != labels[1]


# Two tight pairs inside each loose group: counting the point itself among its neighbours
# (scikit-learn's default with min_samples = min_cluster_size = 2) makes the pairs clusters
# of their own; the hdbscan package's count (the official code's) keeps each group whole.
GROUPS = np.array(
    [
        *([0, 0], [0.1, 0], [1, 0], [1.1, 0], [0.5, 0.8]),
        *([6, 6], [6.1, 6], [7, 6], [7.1, 6], [6.5, 6.9], [6.5, 5.2]),
        *([-5, 4], [-4.9, 4], [-5.4, 4.6]),
    ]
)


def _mixtures(count: int) -> list[np.ndarray]:
    """Seeded 2-D Gaussian mixtures of 8-60 points and 1-5 components."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        n, k = int(rng.integers(8, 60)), int(rng.integers(1, 6))
        centres = rng.normal(size=(k, 2)) * 6
        out.append(centres[rng.integers(0, k, n)] + rng.normal(size=(n, 2)))
    return out


def _package_centres(fitted: Any) -> np.ndarray:
    k = int(fitted.labels_.max()) + 1
    return np.array([fitted.weighted_cluster_centroid(g) for g in range(k)]).reshape(-1, 2)


def test_clusters_as_the_official_code_calls_the_hdbscan_package() -> None:
    hdbscan = pytest.importorskip("hdbscan")
    from sklearn.cluster import HDBSCAN

    official = hdbscan.HDBSCAN(min_cluster_size=2, allow_single_cluster=False).fit(GROUPS)
    ours = cluster(GROUPS, 2)
    assert ours.labels.tolist() == official.labels_.tolist() == [1] * 5 + [0] * 6 + [2] * 3
    # Its Boruvka tree gives some points other membership probabilities (ties, see the next
    # test), so the weighted centres move a little; the member nearest each is the same.
    theirs = _package_centres(official)
    assert np.allclose(ours.centres, theirs, atol=5e-3)
    nearest = [np.argmin(np.linalg.norm(GROUPS - c, axis=1)) for c in theirs]
    assert ours.nearest.tolist() == nearest == [6, 1, 11]
    # The count before the fix splits the groups into their pairs.
    before = HDBSCAN(min_cluster_size=2, copy=True).fit_predict(GROUPS)
    assert before.max() + 1 == 5 and before.tolist() != ours.labels.tolist()
    # min_samples is the package's count too, and capped at n - 1 as the package caps it.
    wide = hdbscan.HDBSCAN(min_cluster_size=2, min_samples=4).fit(GROUPS).labels_
    assert _same_partition(cluster(GROUPS, 2, min_samples=4).labels, wide)
    assert wide.max() + 1 == 2  # fewer clusters than at min_samples 2: the count matters
    for n in (2, 3, 5, 11):
        small = hdbscan.HDBSCAN(min_cluster_size=2, min_samples=7).fit(GROUPS[:n]).labels_
        assert _same_partition(cluster(GROUPS[:n], 2, min_samples=7).labels, small)


def test_labels_and_centres_equal_the_package_under_its_prim_tree() -> None:
    """Exactly equal on every mixture; its default Boruvka tree orders tied merges otherwise
    (``pytest -s`` prints how often the partition differs: the figures of the module doc)."""
    hdbscan = pytest.importorskip("hdbscan")
    differ = more = fewer = 0
    for x in _mixtures(200):
        prim = hdbscan.HDBSCAN(min_cluster_size=2, algorithm="prims_kdtree").fit(x)
        ours = cluster(x, 2)
        assert ours.labels.tolist() == prim.labels_.tolist()
        assert np.allclose(ours.centres, _package_centres(prim))
        boruvka = hdbscan.HDBSCAN(min_cluster_size=2).fit(x).labels_
        if not _same_partition(boruvka, ours.labels):
            differ += 1
            more += int(boruvka.max() > ours.labels.max())
            fewer += int(boruvka.max() < ours.labels.max())
    print(f"Boruvka's partition differs on {differ} of 200: {more} more clusters, {fewer} fewer")


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two labelings make the same clusters and the same noise (ids may differ)."""
    if not np.array_equal(a == -1, b == -1):
        return False
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len({x for x, _ in pairs}) == len({y for _, y in pairs})


def _select_reply(xy: list[list[float]], n: int = 10) -> Message:
    return Message(
        "select",
        {"centroids": {"xy": torch.tensor(xy, dtype=torch.float32).reshape(-1, 2)}},
        {
            "num_examples": n,
            "cluster_ids": list(range(len(xy))),
            "use_all": False,
            "feature_s": 0.5,
            "cluster_s": 0.25,
        },
    )


def _fake(
    algo: FedHDS, select: dict[str, Message], value: dict[str, float], n: dict[str, int]
) -> FakeFederation:
    """Clients answer ``select`` from ``select`` and ``train`` with every tensor = value[cid],
    claiming a coreset of ``n[cid]`` rows."""

    def reply(cid: str, msg: Message) -> Message:
        if msg.kind == "select":
            return select[cid]
        ups = {n: torch.full_like(t, value[cid]) for n, t in algo.params.items()}
        meta = {"num_examples": n[cid], "loss": 1.0, "pool_examples": 10, "train_s": 2.0}
        return Message("train", {"global": ups}, meta)

    return FakeFederation(list(select), reply, kinds=algo.messages)


def test_server_half_selects_global_clusters_and_trains_only_their_owners(tmp_path) -> None:
    algo = _algo(tmp_path, dp_sigma=0.5)
    algo.params = {k: torch.zeros_like(v) for k, v in algo.params.items()}
    select = {
        "0": _select_reply([[-1, 0], [20, 20]]),  # its cluster 1 is group 2's middle
        "1": _select_reply([[1, 0], [20, 19]]),  # nothing of it is selected
        "2": _select_reply([[0, 0], [20, 21]]),  # its cluster 0 is group 1's middle
        "3": _select_reply([[-60, 70]]),  # noise only
    }
    select["4"] = _select_reply([[300, -200]])  # far from everything: noise
    select["5"] = _select_reply([[-300, 250]])
    fed = _fake(algo, select, {"0": 1.0, "2": 4.0}, {"0": 1, "2": 3})
    metrics = algo.round(fed)
    trains = [(c, m.meta) for _, c, m in fed.sent if m.kind == "train"]
    assert trains == [
        ("0", {"plan": "clusters", "pick": [1]}),
        ("2", {"plan": "clusters", "pick": [0]}),
    ]
    # FedAvg weighted by coreset size, from θ = 0: (1·1 + 3·4) / (1 + 3) = 3.25.
    assert all(torch.allclose(v, torch.full_like(v, 3.25)) for v in algo.params.values())
    assert metrics["clients_trained"] == 2 and metrics["coreset"] == 4
    assert metrics["data_fraction"] == pytest.approx(4 / 60)  # 6 clients of 10 rows asked
    assert metrics["feature_s"] == pytest.approx(3.0) and metrics["train_s"] == pytest.approx(4.0)
    assert metrics["global_clusters"] == 2 and metrics["centroids"] == 9
    # Every released centroid set is in the ledger with the tanh box's diameter.
    ledger = {(m.client, m.sensitivity) for m in algo.privacy.mechanisms}
    assert ("0", release_sensitivity(2)) in ledger and ("3", 2 * math.sqrt(2)) in ledger
    assert release_sensitivity(2) == pytest.approx(4.0)
    log = [json.loads(x) for x in algo.artefacts.read_bytes("selection.jsonl").splitlines()]
    assert [r["trained"] for r in log if r["client"] is not None] == [
        True,
        False,
        True,
        False,
        False,
        False,
    ]
    assert log[-1]["noise_centroids"] == 3


def test_no_cluster_anywhere_selects_nothing_and_the_round_goes_on(tmp_path: Path) -> None:
    algo = _algo(tmp_path)
    before = {k: v.clone() for k, v in algo.params.items()}
    select = {c: _select_reply([]) for c in "012345"}
    fed = _fake(algo, select, {}, {})
    metrics = algo.round(fed)
    assert [m.kind for _, _, m in fed.sent] == ["select"] * 6
    assert metrics["clients_trained"] == 0 and metrics["data_fraction"] == 0
    assert all(torch.equal(before[k], algo.params[k]) for k in before)


def test_a_client_too_small_to_cluster_trains_on_all_its_rows(tmp_path: Path) -> None:
    algo, client = _halves(tmp_path, min_cluster_size=9)  # every client holds 8 rows
    state = ClientState()
    ctx = ClientContext("0", "default", 1, 0, algo.task, state)
    msg = algo.select_message("centroids")
    with torch.inference_mode():
        reply = client.select(ctx, msg)
    assert reply.meta["use_all"] is True and not reply.arrays
    select = {c: reply for c in "012345"}
    fed = _fake(algo, select, dict.fromkeys("012345", 1.0), dict.fromkeys("012345", 8))
    algo.round(fed)
    trains = [m.meta["plan"] for _, _, m in fed.sent if m.kind == "train"]
    assert trains == ["all"] * 6
    everything = Message("train", {"global": algo.params}, {"plan": "all", "pick": []})
    train = client.train(ctx, everything)
    assert train.meta["num_examples"] == 8


def test_random_baseline_takes_its_budget_of_each_client(tmp_path: Path) -> None:
    algo, client = _halves(tmp_path, selection="random", random_budget=0.25)
    ctx = ClientContext("1", "default", 1, 0, algo.task, ClientState())
    msg = Message("train", {"global": algo.params}, {"plan": "random", "pick": []})
    assert client.train(ctx, msg).meta["num_examples"] == 2  # a quarter of 8 rows


# ----------------------------------------------------------------------------- runs and audit


def test_only_centroids_and_lora_leave_clients(runs: dict[str, Path]) -> None:
    audit = jsonl_rows(runs["hds"] / "audit.jsonl")
    up = [a for a in audit if a["direction"] == "up"]
    arrays = {(a["kind"], a["field"]) for a in up if a["type"] == "arrays"}
    assert arrays == {("select", "centroids"), ("train", "global")}
    meta = {a["field"] for a in up if a["type"] == "meta"}
    assert meta <= {
        "num_examples",
        "cluster_ids",
        "use_all",
        "feature_s",
        "cluster_s",
        "loss",
        "pool_examples",
        "train_s",
    }
    cents = [a for a in up if a["field"] == "centroids"]
    assert cents and all(a["shape"][1:] == [2] and a["dtype"] == "float32" for a in cents)
    assert all(a["bytes"] == 8 * a["shape"][0] for a in cents)  # two float32 per cluster


def test_no_train_message_reaches_an_unselected_client(runs: dict[str, Path]) -> None:
    audit = jsonl_rows(runs["hds"] / "audit.jsonl")
    log = jsonl_rows(runs["hds"] / "artefacts" / "selection.jsonl")
    for rnd in (1, 2):
        told = {a["client"] for a in audit if a["round"] == rnd and a["kind"] == "train"}
        chosen = {r["client"] for r in log if r["round"] == rnd and r.get("selected")}
        asked = {a["client"] for a in audit if a["round"] == rnd and a["kind"] == "select"}
        assert told == chosen and told < asked  # some clients are left out of training
    rows = jsonl_rows(runs["hds"] / "metrics.jsonl")
    assert all(0 < r["data_fraction"] < 1 for r in rows[1:])


def test_global_select_sends_every_point_and_more_bytes(runs: dict[str, Path]) -> None:
    def select_up(run: Path) -> int:
        audit = jsonl_rows(run / "audit.jsonl")
        return sum(a["bytes"] for a in audit if a["kind"] == "select" and a["direction"] == "up")

    points = [a for a in jsonl_rows(runs["global"] / "audit.jsonl") if a["field"] == "points"]
    assert points and all(a["shape"] == [8, 2] for a in points)
    assert select_up(runs["global"]) > select_up(runs["hds"])


def test_turbo_features_come_once_per_client_and_need_no_adapter(runs: dict[str, Path]) -> None:
    audit = jsonl_rows(runs["turbo"] / "audit.jsonl")
    down = {a["field"] for a in audit if a["kind"] == "select" and a["direction"] == "down"}
    assert down == {"send"}  # no adapter in the select message
    rows = jsonl_rows(runs["turbo"] / "metrics.jsonl")
    assert rows[1]["feature_s"] > 0 and rows[2]["feature_s"] < rows[1]["feature_s"] / 10
    summary = json.loads((runs["turbo"] / "summary.json").read_text())
    assert summary["finish"]["total_feature_s"] == pytest.approx(
        rows[1]["feature_s"] + rows[2]["feature_s"]
    )


def test_turbo_client_keeps_its_features_in_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    algo, client = _halves(tmp_path, feature_model="tiny-llama", feature_model_args=TURBO)
    calls = []
    model = client.features.feature_model()  # the process's encoder: patched for this test only
    real = model.layer_features
    monkeypatch.setattr(model, "layer_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    state = ClientState()
    for rnd in (1, 2):
        ctx = ClientContext("0", "default", rnd, 0, algo.task, state)
        with torch.inference_mode():
            client.select(ctx, algo.select_message("centroids"))
    assert len(calls) == 1
    assert state.get_group("turbo")["features"].shape == (8, 2 * 16)


def test_turbo_pools_a_bert_style_encoder_by_its_token_mean_and_an_llm_by_its_last_token(
    tmp_path: Path,
) -> None:
    from fedfm.algorithms.fedhds import _raw_text
    from helpers.models import register_tiny_bert

    _, client = _halves(tmp_path / "bert", feature_model=register_tiny_bert())
    assert client.cfg.feature_pool == "auto"
    data = client.task.client_data("0")
    texts = [_raw_text(data.rows[i]) for i in client.features.usable("0", data)[0]]
    stack = client.features.feature_model().stack()
    got = client.features.raw_features(data, "0")
    assert np.array_equal(got, flatten_features(stack.features(texts, pool="mean")))
    assert not np.allclose(got, flatten_features(stack.features(texts, pool="last")))
    _, llm = _halves(tmp_path / "llm", feature_model="tiny-llama", feature_model_args=TURBO)
    small = llm.features.feature_model().stack()
    got = llm.features.raw_features(data, "0")
    assert np.array_equal(got, flatten_features(small.features(texts, pool="last")))


# ----------------------------------------------------------------------------- DP


def test_dp_noise_has_the_configured_std_around_the_tanh_of_each_coordinate() -> None:
    rng = np.random.default_rng(0)
    xy = np.array([[3.0, -0.5]])
    draws = np.stack([privatise(xy, 0.3, rng) for _ in range(20000)])  # (20000, 1, 2)
    noise = draws - np.tanh(xy)
    assert abs(noise.mean()) < 0.01 and noise.std() == pytest.approx(0.3, rel=0.02)
    assert np.allclose(privatise(xy, 0.0, rng, scale=2.0), np.tanh(xy / 2))


def test_client_release_under_dp_is_noisy_and_registered(tmp_path: Path) -> None:
    algo, client = _halves(tmp_path, dp_sigma=0.2)
    ctx = ClientContext("0", "default", 1, 0, algo.task, ClientState())
    with torch.inference_mode():
        reply = client.select(ctx, algo.select_message("centroids"))
    xy = reply.arrays["centroids"]["xy"]
    ids = reply.meta["cluster_ids"]
    assert isinstance(ids, list) and xy.shape == (len(ids), 2)
    assert float(xy.abs().max()) < 1 + 6 * 0.2  # tanh'd to [-1, 1], then noise
    algo.register_release("0", len(ids))
    (mech,) = algo.privacy.mechanisms
    assert (mech.kind, mech.name, mech.sigma) == ("gaussian", "centroids", 0.2)
    assert mech.sensitivity == pytest.approx(2 * math.sqrt(2 * len(ids)))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("perplexity", 0.5, "algo.perplexity"),
        ("min_cluster_size", 1, "algo.min_cluster_size"),
        ("server_min_cluster_size", 1, "algo.server_min_cluster_size"),
        ("selection", "kmeans", "algo.selection"),
        ("dp_sigma", -1, "algo.dp_sigma"),
    ],
)
def test_bad_values_fail_at_load_naming_the_field(tmp_path, key, value, field) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(load_config(make_config(FEDHDS, tmp_path, name="bad", algo={key: value})))
    assert err.value.field == field and "\n" not in str(err.value)


def test_an_unknown_feature_model_names_its_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build(
            load_config(
                make_config(FEDHDS, tmp_path, name="bad", algo={"feature_model": "no-such-model"})
            )
        )
    assert err.value.field == "algo.feature_model"


def test_presets_validate() -> None:
    for name in ("fedhds", "fedhds-turbo"):
        algo, _ = resolve(load_config(name))
        assert algo.selection == "hierarchical"
    assert resolve(load_config("fedhds-turbo"))[0].feature_model == "all-minilm-l6-v2"


# ----------------------------------------------------------------------------- baselines


def test_selection_all_is_fedit_exactly(tmp_path: Path) -> None:
    """``selection: all`` gives the same adapter as FedAvg on the same task after a round."""
    algo = {"selection": "all"}
    cfg = make_config(FEDHDS, tmp_path, name="all", partition__num_clients=3, algo=algo)
    cfg = load_config(cfg).model_dump()
    cfg.update(rounds=1)
    run_experiment(load_config(cfg), progress=False)
    fedit = {**cfg, "name": "fedit", "algorithm": "fedavg", "algo": {}}
    run_experiment(load_config(fedit), progress=False)
    ours = load_file(str(_latest(tmp_path / "all") / "server.safetensors"))
    theirs = load_file(str(_latest(tmp_path / "fedit") / "server.safetensors"))
    mine = {k.removeprefix("params/"): v for k, v in ours.items() if k.startswith("params/")}
    ref = {k.removeprefix("params/"): v for k, v in theirs.items() if k.startswith("params/")}
    assert len(mine) == len(ref) > 0
    for key, value in ref.items():  # fedavg names the adapter in its keys; ours do not
        short = key.replace(".default", "")
        assert torch.allclose(mine[short], value, atol=1e-6), key
    rows = jsonl_rows(tmp_path / "all" / "metrics.jsonl")
    assert rows[1]["data_fraction"] == 1.0
    assert rows[1]["score"] == pytest.approx(
        jsonl_rows(tmp_path / "fedit" / "metrics.jsonl")[1]["score"]
    )
    assert "rougeL_all" in rows[1] and all(f"rougeL_all/{d}" in rows[1] for d in ("math", "spam"))


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()


def test_single_level_trains_every_client_cluster_without_centroids(tmp_path: Path) -> None:
    algo = _algo(tmp_path, selection="single-level")
    ids_only = Message(
        "select",
        meta={
            "num_examples": 8,
            "cluster_ids": [0, 1, 2],
            "use_all": False,
            "feature_s": 0.1,
            "cluster_s": 0.1,
        },
    )
    select = {c: ids_only if c != "3" else _select_reply([]) for c in "012345"}
    fed = _fake(algo, select, dict.fromkeys("012345", 1.0), dict.fromkeys("012345", 3))
    algo.round(fed)
    sent = [(c, m.kind, m.meta) for _, c, m in fed.sent]
    assert all(m == {"send": "ids"} for _, k, m in sent if k == "select")
    trains = [(c, m["pick"]) for c, k, m in sent if k == "train"]
    assert trains == [(c, [0, 1, 2]) for c in "01245"]


def test_centralised_reference_reads_client_data_and_says_so(tmp_path: Path) -> None:
    algo = _algo(tmp_path, selection="centralised")
    fed = _fake(
        algo,
        {c: _select_reply([]) for c in "012345"},
        dict.fromkeys("012345", 1.0),
        dict.fromkeys("012345", 1),
    )
    metrics = algo.round(fed)
    assert metrics["non_private"] == 1.0
    assert {m.kind for _, _, m in fed.sent} <= {"train"}  # no select exchange: it is not private
    plans = [m.meta for _, _, m in fed.sent]
    assert all(p["plan"] == "positions" and p["pick"] for p in plans)
    assert metrics["coreset"] == len(plans)  # the fake's replies claim one row each


# ----------------------------------------------------------------------------- evaluation


def test_rouge_of_every_item_weighs_each_domain_alike() -> None:
    items = [
        {"domain": "a", "answer": "the cat sat", "reference": "the cat sat"},  # 1
        {"domain": "a", "answer": "dog", "reference": "cat"},  # 0
        {"domain": "b", "answer": "positive", "reference": "positive"},  # 1
        {"domain": "z", "answer": "spam", "reference": "ham", "zeroshot": True},  # 0
    ]
    out = rouge_all(items)
    assert out == {
        "rougeL_all": 0.75,
        "rougeL_all/a": 0.5,
        "rougeL_all/b": 1.0,
        "zeroshot/rougeL_all": 0.0,
    }


def test_evaluated_items_are_kept_with_their_rouge(runs: dict[str, Path]) -> None:
    rows = jsonl_rows(runs["hds"] / "eval_items.jsonl")
    assert [r["round"] for r in rows][-1] == 2
    items = rows[-1]["items"]
    final = jsonl_rows(runs["hds"] / "metrics.jsonl")[-1]
    seen = [i for i in items if not i["zeroshot"]]
    domains = sorted({i["domain"] for i in seen})
    per = [np.mean([i["rougeL"] for i in seen if i["domain"] == d]) for d in domains]
    assert final["rougeL_all"] == pytest.approx(float(np.mean(per)))
    assert len(items) == final["n"]


@pytest.mark.usefixtures("task_identity")
def test_flower_runtime_selects_and_trains_as_embedded(tmp_path: Path) -> None:
    """FedHDS's ServerApp and ClientApps on the in-memory grid (Flower's serde on every
    record) select and train as the embedded run; Flower's Ray engine itself is checked once,
    on the toy task, by test_flower's simulation test."""
    # Timings differ, and so do the bytes of their JSON meta values (their digits).
    timing = {"time_s", "train_s", "feature_s", "cluster_s", "select_s", "client_s"}
    timing |= {"bytes_up", "bytes_up_meta"}
    rows = {}
    for runtime in ("embedded", "flower"):
        cfg = load_config(make_config(FEDHDS, tmp_path, name=runtime, rounds=1))
        if runtime == "embedded":
            run_experiment(cfg, progress=False)
        else:
            imports = {"imports": ["helpers.flower", "fedfm.algorithms.fedhds"]}
            flower_run(cfg.model_dump(mode="json"), tmp_path / "nodes", options=imports)
        rows[runtime] = [
            {k: v for k, v in r.items() if k not in timing}
            for r in jsonl_rows(tmp_path / runtime / "metrics.jsonl")
        ]
    assert rows["flower"] == rows["embedded"]
    assert rows["embedded"][-1]["clients_trained"] > 0
    logs = [(tmp_path / r / "artefacts" / "selection.jsonl").read_text() for r in rows]
    assert logs[0] == logs[1]


def test_a_malformed_select_reply_is_dropped_and_the_round_goes_on(tmp_path: Path) -> None:
    algo = _algo(tmp_path)
    bad_shape = _select_reply([[0, 0], [1, 1]])
    bad_shape.arrays["centroids"]["xy"] = torch.zeros(3, 2)  # 3 centroids for 2 ids
    repeated = _select_reply([[0, 0], [1, 1]])
    repeated.meta["cluster_ids"] = [0, 0]
    select = {"0": bad_shape, "1": repeated, **{c: _select_reply([]) for c in "2345"}}
    fed = _fake(algo, select, {}, {})
    metrics = algo.round(fed)
    assert metrics["centroids"] == 0 and metrics["clients_trained"] == 0
    log = [json.loads(x) for x in algo.artefacts.read_bytes("selection.jsonl").splitlines()]
    assert {r["client"] for r in log} == {"2", "3", "4", "5", None}


def test_selection_rules_take_what_was_received_and_give_a_plan() -> None:
    """Every rule sees numbers only (no server, client or federation): centroids in, a plan
    out; each coreset rule sees its picks and the client's row count."""
    from fedfm.algorithms.fedhds_selection import (
        CORESETS,
        SELECTIONS,
        ClusterSettings,
        CoresetRequest,
        Received,
    )

    hdb = ClusterSettings(2, 1, 2, 1)
    # Two global clusters, each of one centroid of a and one of b.
    near, far = np.array([[0.0, 0.0], [10.0, 10.0]]), np.array([[0.1, 0.0], [10.1, 10.0]])
    got = Received(["a", "b", "c"], {"a": 9, "b": 7, "c": 1}, ["c"], {"a": [0, 1], "b": [0, 1]})
    got.coords = {"a": near, "b": far}
    choice = SELECTIONS.get("hierarchical").rule(got, hdb)
    assert SELECTIONS.get("hierarchical").send == "centroids"
    picked = [c for pick in choice.train.values() for c in pick[1]]
    assert len(picked) == choice.metrics["global_clusters"] == 2
    assert all(rule == "clusters" for rule, _ in choice.train.values())
    assert "c" not in choice.train and choice.metrics["centroids"] == 4.0  # c: too small
    assert [row["client"] for row in choice.log] == ["a", "b", None]
    single = SELECTIONS.get("single-level").rule(got, hdb)
    assert single.train == {"a": ("clusters", [0, 1]), "b": ("clusters", [0, 1])}
    for name in ("all", "random"):
        assert SELECTIONS.get(name).send is None
        plan = SELECTIONS.get(name).rule(Received(["a", "b"]), hdb).train
        assert plan == {"a": (name, []), "b": (name, [])}
    assert SELECTIONS.get("centralised").rule(Received(["a"], {"a": 1}), hdb).train == {
        "a": ("all", [])  # a pool too small to cluster: every row
    }

    def req(pick: list[int], n: int) -> CoresetRequest:
        return CoresetRequest(pick, n, lambda: {"0": 3, "1": 5}, budget=0.5, seed=1)

    assert CORESETS.get("clusters")(req([1, 0], 8)) == [5, 3]
    assert CORESETS.get("positions")(req([2, 0], 3)) == [2, 0]
    assert CORESETS.get("all")(req([], 3)) == [0, 1, 2]
    drawn = CORESETS.get("random")(req([], 8))
    assert len(drawn) == 4 and drawn == sorted(set(drawn)) and max(drawn) < 8
    for name, pick in (("positions", [3]), ("clusters", [2])):
        with pytest.raises(ValueError):
            CORESETS.get(name)(req(pick, 3))
