"""Tasks; importing this package registers them."""

from fedfm.tasks import supervised, text  # noqa: F401
