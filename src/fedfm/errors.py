"""Errors that fedfm reports to users as one clear line."""

from __future__ import annotations


class FedfmError(Exception):
    """Base class of every error fedfm raises on purpose."""


class ConfigError(FedfmError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    Args:
        field: Dotted path of the offending field, e.g. ``"train.lr"``.
        reason: Why the value is refused.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"config error: {field}: {reason}")


class UnknownNameError(ConfigError):
    """A name looked up in a registry does not exist."""


class AssetMissingError(FedfmError):
    """An offline asset (package, file, Debian data set) is not installed."""


class UpdateRejectedError(FedfmError):
    """A client's reply failed validation (NaN/Inf, wrong shape or dtype, unknown key).

    Args:
        client: Client id.
        field: Message field (and tensor name) that failed.
        reason: What is wrong.
    """

    def __init__(self, client: str, field: str, reason: str) -> None:
        self.client = client
        self.field = field
        self.reason = reason
        super().__init__(f"update rejected: client {client}: field {field}: {reason}")


class MessageError(FedfmError):
    """A message carries undeclared fields or has a kind nobody handles."""


class TooFewClientsError(FedfmError):
    """A round ended with fewer surviving clients than ``min_clients``."""
