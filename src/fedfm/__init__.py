"""fedfm: federated adaptation and distillation of foundation models."""

__version__ = "0.1.0"
