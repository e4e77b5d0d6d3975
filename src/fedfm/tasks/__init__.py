"""Tasks; importing this package registers them."""

from fedfm.tasks import supervised  # noqa: F401
