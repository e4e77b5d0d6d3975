"""Errors that fedfm reports to users as one clear line."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager


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

    def renamed(self, prefixes: Mapping[str, str]) -> ConfigError:
        """The same error with its field moved under the config path that supplied it.

        Args:
            prefixes: Field prefix -> replacement, e.g. ``{"model": "task.model_args"}``
                turns ``model.hidden`` into ``task.model_args.hidden``. Prefixes match whole
                dotted components; the longest match wins.

        Returns:
            ``self`` when no prefix matches, else a new error of the same class.
        """
        parts = self.field.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in prefixes:
                field = ".".join([prefixes[head], *parts[n:]])
                err = type(self).__new__(type(self))
                ConfigError.__init__(err, field, self.reason)
                return err
        return self


@contextmanager
def config_fields(prefixes: Mapping[str, str]) -> Iterator[None]:
    """Names config errors raised inside by the config path of the offending value.

    Builders (models, data sources) name their own arguments (``model.hidden``); the code
    that calls them with a config section knows where the values came from and wraps the
    call, so the user reads ``task.model_args.hidden``.

    Args:
        prefixes: See :meth:`ConfigError.renamed`.
    """
    try:
        yield
    except ConfigError as e:
        renamed = e.renamed(prefixes)
        if renamed is e:
            raise
        raise renamed from None


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
