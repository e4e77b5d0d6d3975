"""Arrow building and reading for ``datasets.Dataset`` columns, straight from numpy.

Used by every source (:func:`build_dataset`) and by the tasks and partitioners that read a
column back (:func:`column_array`): ``datasets`` 4 goes row by row both ways, which takes
seconds for 60k images.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.features.features import Array2DExtensionType


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
    """One column as a numpy array.

    ``[n]`` scalars (strings as objects), ``[n, d]`` for a fixed-length list such as ``x``, ``[n, h,
    w]`` in the stored dtype for an ``Array2D`` image.

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
