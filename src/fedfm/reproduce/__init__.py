"""Reproduction studies: ``fedfm reproduce NAME`` runs a grid of experiments and writes a report.

Every study is one module of this package, declared on :mod:`fedfm.reproduce.framework`.
"""

from fedfm.reproduce.framework import STUDIES, load_studies

__all__ = ["STUDIES", "load_studies"]
