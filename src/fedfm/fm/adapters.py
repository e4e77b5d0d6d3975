"""The named LoRA adapters of a shared base: slots that any handle on that base sees.

peft wraps the base once, when its first adapter is made (:mod:`fedfm.fm.bases` keeps the
``PeftModel`` in the base's cache entry); every adapter is then a slot of the process, shared
by every simulated client and run. :meth:`AdapterSlots.slot` is how code reads or trains one:
it loads the tensors it is given and puts back what the slot held when the block ends.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import peft
import torch
from torch import Tensor

from fedfm.errors import ConfigError, UnknownNameError
from fedfm.fm.bases import SharedLM, cached
from fedfm.models.lora import (
    LoraConfigSpec,
    active_adapters,
    adapter_names,
    adapter_param_names,
    add_adapters,
    get_adapter_state,
    load_adapter,
    save_adapter,
    set_active,
    set_adapter_state,
    trainable_adapters,
)

Arrays = dict[str, Tensor]


class AdapterSlots:
    """The adapters of the shared base under ``key``.

    Args:
        key: The base's key in the process cache (:func:`fedfm.fm.bases.base_key`).
        entry: Loads the base's cache entry (on first use).
        lora: LoRA hyper-parameters of adapters created without their own spec.
    """

    def __init__(self, key: str, entry: Callable[[], SharedLM], lora: LoraConfigSpec) -> None:
        self.key = key
        self.entry = entry
        self.lora = lora

    @property
    def model(self) -> torch.nn.Module:
        """The shared ``PeftModel``, or the bare base while no adapter exists yet."""
        model = self.adapted()
        return model if model is not None else self.entry().bundle.model

    def adapted(self) -> peft.PeftModel | None:
        """The shared ``PeftModel`` once an adapter exists (nothing is loaded here)."""
        found = cached(self.key)
        return found.adapted if found is not None else None

    def names(self) -> list[str]:
        """Every adapter on the shared model, in creation order (a reset one moves last)."""
        model = self.adapted()
        return adapter_names(model) if model is not None else []

    def has(self, name: str) -> bool:
        """Whether adapter ``name`` exists."""
        return name in self.names()

    @property
    def active(self) -> list[str]:
        """Adapters used in the forward pass now."""
        model = self.adapted()
        return active_adapters(model) if model is not None else []

    @property
    def trainable(self) -> list[str]:
        """Adapters whose tensors receive gradients now."""
        model = self.adapted()
        return trainable_adapters(model) if model is not None else []

    def add(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
        """Creates adapter ``name``, inactive and frozen, leaving every other adapter as it was.

        Args:
            name: New adapter name (no dots).
            seed: Seeds the ``A`` matrices (``B = 0``); the global RNG is left untouched.
            lora: Its LoRA hyper-parameters; the handle's ``lora`` when ``None``.

        Raises:
            ConfigError: ``name`` exists already or is not a valid name (field
                ``lora.adapters``).
        """
        spec = lora or self.lora
        model = self.adapted()
        # Ordinary tensors even inside a no-grad handler (inference mode), or training the
        # adapter later would fail.
        with torch.inference_mode(False):
            if model is None:
                entry = self.entry()
                entry.adapted = add_adapters(entry.bundle.model, [name], spec, seed=seed)
                set_active(entry.adapted, [], [])
                return
            keep = (self.active, self.trainable)
            add_adapters(model, [name], spec, seed=seed)
            # peft re-enables gradients of every active adapter it adds one to: restore them.
            set_active(model, *keep)

    def ensure(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> bool:
        """Creates adapter ``name`` (see :meth:`add`) unless it exists.

        Returns:
            Whether it was created.
        """
        if self.has(name):
            return False
        self.add(name, seed, lora)
        return True

    def reset(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
        """Gives adapter ``name`` a fresh seeded init (created when missing).

        The result equals a first :meth:`add` with this seed and spec. Whether it is
        active or trainable is kept.
        """
        if not self.has(name):
            self.add(name, seed, lora)
            return
        active, trainable = self.active, self.trainable
        self.delete(name)
        self.add(name, seed, lora)
        self.choose(active, trainable)

    def delete(self, name: str) -> None:
        """Removes adapter ``name``; the others keep their tensors and status.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        model = self.peft([name])
        active = [a for a in self.active if a != name]
        trainable = [a for a in self.trainable if a != name]
        with warnings.catch_warnings():  # peft warns that it picks a new active adapter; we do
            warnings.simplefilter("ignore", UserWarning)
            model.delete_adapter(name)
        if adapter_names(model):
            set_active(model, active, trainable)

    def choose(self, active: Sequence[str], trainable: Sequence[str] = ()) -> None:
        """Chooses the adapters of the forward pass and those that receive gradients.

        Args:
            active: Adapters whose deltas are added in the forward pass; ``[]``: the base.
            trainable: A subset of ``active``; every other parameter is frozen.

        Raises:
            UnknownNameError: A name is not an adapter (field ``lora.adapter``).
            ConfigError: ``trainable`` is not a subset of ``active`` (field ``lora.trainable``).
        """
        active, trainable = list(active), list(trainable)
        if not active and not trainable and self.adapted() is None:
            return  # the bare base is already what was asked for
        set_active(self.peft([*active, *trainable]), active, trainable)

    @contextlib.contextmanager
    def use(
        self, active: Sequence[str], trainable: Sequence[str] = ()
    ) -> Iterator[torch.nn.Module]:
        """Within the block, ``active`` adapters are used and ``trainable`` ones get gradients.

        Yields:
            The model to call (train it with :func:`fedfm.core.train.local_train`); the
            previous choice of active and trainable adapters is restored on exit.
        """
        before = (self.active, self.trainable)
        self.choose(active, trainable)
        try:
            yield self.model
        finally:
            if self.adapted() is not None:
                self.choose(*before)

    def get(self, name: str) -> Arrays:
        """Detached CPU copies of adapter ``name``'s tensors; keys do not name the adapter.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        return get_adapter_state(self.peft([name]), name)

    def put(self, name: str, state: Mapping[str, Tensor]) -> None:
        """Copies ``state`` (from :meth:`get` of any same-shaped adapter) into ``name``.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
            AdapterStateError: Keys or shapes differ.
        """
        set_adapter_state(self.peft([name]), name, dict(state))

    def get_many(self, names: Sequence[str]) -> dict[str, Arrays]:
        """``{name: get_adapter(name)}``: one message array field per adapter."""
        return {name: self.get(name) for name in names}

    def param_names(self, name: str) -> dict[str, str]:
        """Parameter name in :attr:`model` of each of adapter ``name``'s tensors.

        Keyed as :meth:`get` gives them, for training loops that find tensors by name.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        return adapter_param_names(self.peft([name]), name)

    def save(self, name: str, folder: str | Path) -> Path:
        """Writes adapter ``name`` in peft's format into ``folder``.

        The folder holds ``adapter_config.json`` and ``adapter_model.safetensors``: plain peft loads
        it with ``PeftModel.from_pretrained(base, folder)``, :meth:`read` into any handle.
        """
        return save_adapter(self.peft([name]), name, folder)

    def read(self, name: str, folder: str | Path) -> None:
        """Loads a peft adapter folder (from :meth:`save`) as adapter ``name``.

        Replaces the adapter's tensors when it exists (see :func:`fedfm.models.lora.load_adapter`).

        Raises:
            AssetMissingError: ``folder`` holds no peft adapter.
        """
        if self.adapted() is None:  # peft needs one adapter to wrap the base
            self.ensure(name, seed=0)
        load_adapter(self.peft([]), name, folder)

    def load(
        self,
        name: str,
        state: Mapping[str, Tensor] | None,
        seed: int,
        lora: LoraConfigSpec | None = None,
    ) -> None:
        """Puts ``state`` into adapter ``name``, or a fresh seeded init when ``state`` is empty.

        The way to restore a client's own adapter from its persistent state: a client seen for
        the first time gets ``reset_adapter(name, seed)``, never the tensors another client
        left in the shared slot. The adapter is created when missing.
        """
        if state:
            self.ensure(name, seed, lora)
            self.put(name, state)
        else:
            self.reset(name, seed, lora)

    @contextlib.contextmanager
    def slot(
        self,
        name: str,
        state: Mapping[str, Tensor] | None,
        seed: int = 0,
        lora: LoraConfigSpec | None = None,
    ) -> Iterator[None]:
        """Within the block adapter ``name`` holds ``state``; on exit what it held before.

        An empty ``state`` gives a fresh seeded init (see :meth:`load`).

        The way a handler or a server step reads or trains an adapter: the slot is shared by
        every simulated client and run of the process, so what it holds outside a block is
        nobody's. A slot the block created stays (peft keeps its layers), with the block's
        tensors. Blocks nest (a client's inside the server's, one slot per adapter).
        """
        before = self.get(name) if self.has(name) else None
        self.load(name, state, seed, lora)
        try:
            yield
        finally:
            now = self.get(name) if before is not None else {}
            if before is not None and all(
                k in now and now[k].shape == v.shape for k, v in before.items()
            ):
                self.put(name, before)

    def peft(self, names: Sequence[str]) -> peft.PeftModel:
        """The shared PeftModel; an unknown adapter name is one line naming the field."""
        model = self.adapted()
        have = adapter_names(model) if model is not None else []
        for name in names:
            if name not in have:
                listed = ", ".join(have) or "none"
                raise UnknownNameError("lora.adapter", f"unknown adapter '{name}' (have {listed})")
        if model is None:
            raise ConfigError("lora.adapter", "the model has no adapters yet")
        return model
