"""Image sources (Fashion-MNIST, scikit-learn's digits).

Columns ``id``, ``image`` (``Array2D`` uint8, H×W) and ``label``.
"""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import datasets
import numpy as np

from fedfm.data.arrow import build_dataset
from fedfm.data.sources.packaged import SKLEARN, SKLEARN_LICENSE
from fedfm.data.sources.registry import LoadedSource, SourceInfo, register_source, source_info
from fedfm.errors import AssetMissingError

log = logging.getLogger("fedfm.data")

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
    info = source_info("fashion_mnist")
    return LoadedSource(info, train, test, 10, list(FASHION_CLASSES))


@register_source(
    SourceInfo(
        "digits",
        "image-classification",
        SKLEARN,
        f"{SKLEARN_LICENSE}; data UCI optical digits, CC BY 4.0",
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
    return LoadedSource(source_info("digits"), ds, None, 10, names)
