"""Tasks; importing this package registers them."""

from fedfm.tasks import lm, supervised, text  # noqa: F401
