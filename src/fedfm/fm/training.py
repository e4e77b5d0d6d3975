"""Training what a handle holds: full weights of the shared base, and DP-SGD.

DP-SGD trains adapters or weights (one function for both).
:class:`~fedfm.fm.FoundationModel` exposes these as
:meth:`~fedfm.fm.FoundationModel.full_weights`, :meth:`~fedfm.fm.FoundationModel.get_weights`
and :meth:`~fedfm.fm.FoundationModel.dp_train`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from fedfm.config import TrainConfig
from fedfm.core.groups import join_groups
from fedfm.errors import ConfigError
from fedfm.models.generation import pad_id_of

if TYPE_CHECKING:
    from fedfm.core.dp import DPResult, DPSGDConfig
    from fedfm.core.state import ClientState
    from fedfm.models.causal_lm import LMBundle

Arrays = dict[str, Tensor]


class Handle(Protocol):
    """What training reads of a handle (:class:`fedfm.fm.FoundationModel` is one)."""

    @property
    def bundle(self) -> LMBundle:
        """The shared base and its tokenizer."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The base's tokenizer."""
        ...

    def use(
        self, active: Sequence[str], trainable: Sequence[str] = ()
    ) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Adapters chosen for a block."""
        ...

    def dp_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for DP-SGD."""
        ...

    def param_names(self, name: str) -> dict[str, str]:
        """An adapter's keys -> parameter names."""
        ...

    def get_adapter(self, name: str) -> Arrays:
        """Copies of an adapter's tensors."""
        ...

    def get_adapters(self, names: Sequence[str]) -> dict[str, Arrays]:
        """Copies of several adapters' tensors."""
        ...


@dataclass(frozen=True)
class Adapters:
    """What :meth:`FoundationModel.dp_train` trains: adapters of the shared model.

    Attributes:
        active: Adapters in the forward pass (their deltas add up).
        trainable: The adapters that are trained and privatised (a subset of ``active``).
        frozen: Tensors of the first trainable adapter (its :meth:`FoundationModel.get_adapter`
            keys) that stay frozen: FFA-LoRA's ``A``, so DP-SGD clips and noises ``B`` only.
    """

    active: Sequence[str]
    trainable: Sequence[str]
    frozen: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FullWeights:
    """What :meth:`FoundationModel.dp_train` trains: every base weight, no adapter active.

    Attributes:
        weights: The weights to start from (:meth:`FoundationModel.get_weights` keys).
    """

    weights: Mapping[str, Tensor]


def base_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The base's own parameters by canonical name (tied tensors once, no LoRA tensor).

    peft puts LoRA wrappers inside the base (``q_proj`` becomes ``q_proj.base_layer`` once
    an adapter exists in the process), so the ``base_layer`` segment is dropped: names do
    not depend on whether some run of this process created an adapter.
    """
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        out[".".join(part for part in parts if part != "base_layer")] = param
    return out


def get_weights(fm: Handle) -> Arrays:
    """Detached CPU copies of every base weight (what full fine-tuning trains)."""
    return {n: p.detach().cpu().clone() for n, p in base_params(fm.bundle.model).items()}


@contextlib.contextmanager
def full_weights(
    fm: Handle, state: Mapping[str, Tensor], trainable: bool = False
) -> Iterator[torch.nn.Module]:
    """Within the block the base carries ``state`` (from :func:`get_weights`).

    No adapter is active, and every base weight gets gradients when ``trainable``.

    The base is shared by every handle and run of the process, so its own weights and
    frozen flags come back on exit, whatever happens.

    Raises:
        ConfigError: ``state`` has other names or shapes than the base (field
            ``weights``).
    """
    params = base_params(fm.bundle.model)
    if set(state) != set(params) or any(
        tuple(state[n].shape) != tuple(p.shape) for n, p in params.items()
    ):
        raise ConfigError("weights", "the weights do not match the base model's parameters")
    own = {n: p.detach().clone() for n, p in params.items()}
    with fm.use([]) as model:
        try:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(state[n])
                    p.requires_grad_(trainable)
            yield model
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(own[n])
                    p.requires_grad_(False)


def dp_train(
    fm: Handle,
    rows: Sequence[Mapping[str, Sequence[int]]],
    state: ClientState,
    what: Adapters | FullWeights,
    *,
    train: TrainConfig,
    dp: DPSGDConfig,
    delta: float,
    steps: int,
    planned_steps: int,
    seed: int,
    key: str = "dp",
    field: str = "algo.dp",
) -> tuple[DPResult, Arrays]:
    """DP-SGD (Opacus) on adapters or on every base weight: one function for both.

    The shared model is left without Opacus hooks or attributes, and with the previous
    active and trainable adapters (and, for full weights, its own weights), whatever
    happens.

    Args:
        fm: The handle whose shared model is trained.
        rows: Encoded rows of this client (:meth:`FoundationModel.encode`).
        state: The client's persistent state; its account lives under ``state.meta[key]``.
        what: :class:`Adapters` (the trainable adapters, with the active ones in the
            forward pass) or :class:`FullWeights` (every base weight, starting from the
            given ones; no adapter active).
        train: Optimizer, learning rate and expected batch size (see
            :func:`fedfm.core.dp.dp_train`, the accounting included).
        dp: DP-SGD settings.
        delta: The δ to calibrate and report at.
        steps: Steps of this call.
        planned_steps: Steps the client may take in the whole run (calibration).
        seed: Seeds Poisson sampling and noise.
        key: Where the account lives in ``state.meta``.
        field: Config field named in errors.

    Returns:
        The DP result and the trained tensors: the trainable adapter's (one adapter: its
        :meth:`FoundationModel.get_adapter`; several: grouped by name,
        ``"<adapter>/<key>"``), or every weight (:func:`get_weights`).
    """
    from fedfm.core.dp import dp_train  # Opacus is imported only by runs that use it

    with _training(fm, what) as model:
        res = dp_train(
            model,
            rows,
            state,
            train=train,
            dp=dp,
            delta=delta,
            steps=steps,
            planned_steps=planned_steps,
            seed=seed,
            pad_id=pad_id_of(fm.tokenizer),
            autocast=fm.dp_autocast,
            key=key,
            field=field,
        )
        return res, _trained(fm, what)


def _training(fm: Handle, what: Adapters | FullWeights) -> contextlib.AbstractContextManager[Any]:
    """The model to train ``what`` in (see :func:`dp_train`)."""
    if isinstance(what, FullWeights):
        return full_weights(fm, what.weights, trainable=True)
    if what.frozen:
        return _use_frozen(fm, what)
    return fm.use(what.active, what.trainable)


@contextlib.contextmanager
def _use_frozen(fm: Handle, what: Adapters) -> Iterator[torch.nn.Module]:
    """``fm.use``, with ``what.frozen`` out of training (restored on exit by ``use``)."""
    with fm.use(what.active, what.trainable) as model:
        names = fm.param_names(what.trainable[0])
        live = dict(model.named_parameters())
        for key in what.frozen:
            live[names[key]].requires_grad_(False)
        yield model


def _trained(fm: Handle, what: Adapters | FullWeights) -> Arrays:
    """Copies of the tensors ``what`` trained, in the one key format."""
    if isinstance(what, FullWeights):
        return get_weights(fm)
    if len(what.trainable) == 1:
        return fm.get_adapter(what.trainable[0])
    return join_groups(fm.get_adapters(what.trainable))
