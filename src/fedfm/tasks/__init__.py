"""Tasks; importing this package registers them."""

from fedfm.tasks import codetext, lm, supervised, text  # noqa: F401
