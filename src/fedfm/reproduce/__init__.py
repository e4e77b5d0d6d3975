"""Reproduction studies: ``fedfm reproduce NAME`` runs a grid of experiments and writes a report.

Every study is one module of this package declared on :mod:`fedfm.reproduce.framework` (its
jobs, what it reads of each run, its readouts and its report); the framework runs, records,
reads and reports, and :mod:`fedfm.reproduce.stats` computes every standard error.
"""

from fedfm.reproduce.framework import STUDIES, load_studies

__all__ = ["STUDIES", "load_studies"]
