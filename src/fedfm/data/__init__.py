"""Data: offline sources, a Hugging Face / local-file loader, the instruction suite, partitioners.

Importing the package registers every built-in source in :data:`fedfm.data.sources.SOURCES`.
Partitioners live in :mod:`fedfm.data.partition` (imported on demand: flwr-datasets is slow to
import).
"""

from fedfm.data import hf, instruct, sources  # noqa: F401  (registration side effects)
