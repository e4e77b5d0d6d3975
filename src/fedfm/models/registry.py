"""The model registry: named builders that return an ``nn.Module`` or a loaded bundle.

Builder modules register themselves on import (``@MODELS.register("name")``). Importing them is
deferred to :func:`load_builtin_models` because most pull in transformers or sentence-transformers,
which take seconds to import; ``fedfm.models.registry`` itself stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from fedfm.errors import ConfigError
from fedfm.registry import Registry

MODELS: Registry[Callable[..., Any]] = Registry("model", "model.name")

# Modules that register builders into MODELS. A module absent from the installed tree is skipped,
# so a partial checkout still builds the models it has.
_BUILDER_MODULES = (
    "fedfm.models.causal_lm",
    "fedfm.models.encoders",
    "fedfm.models.vision",
    "fedfm.models.students",
    "fedfm.models.efficientnet_adapter",
)


def load_builtin_models() -> Registry[Callable[..., Any]]:
    """Imports every built-in builder module so that ``MODELS`` is fully populated.

    Returns:
        The populated ``MODELS`` registry (handy for ``fedfm list``).
    """
    for module in _BUILDER_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return MODELS


def build_model(name: str, **kwargs: Any) -> Any:
    """Builds the model registered as ``name``.

    Args:
        name: Registry key, e.g. ``"smollm2-135m-instruct"`` or ``"tiny-llama"``.
        **kwargs: Keyword arguments of that builder.

    Returns:
        Whatever the builder returns (an ``nn.Module``, an ``LMBundle``, a ``SentenceTransformer``).

    Raises:
        UnknownNameError: ``name`` is not registered.
        ConfigError: ``kwargs`` do not match the builder's signature.
    """
    builder = load_builtin_models().get(name)
    try:
        inspect.signature(builder).bind(**kwargs)
    except TypeError as err:
        raise ConfigError("model", f"bad arguments for model '{name}': {err}") from None
    return builder(**kwargs)
