"""The :class:`FoundationModel` handle on a shared base of :mod:`fedfm.fm.bases`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import peft
import torch
from torch import Tensor

from fedfm.config import TrainConfig, validate_section
from fedfm.core.groups import join_groups
from fedfm.data.prompt import (
    PromptConfig,
    chat_prompt,
    encode_example,
    fit_prompt,
    fit_template,
)
from fedfm.devices import autocast, model_device
from fedfm.errors import ConfigError, UnknownNameError
from fedfm.fm.bases import SharedLM, base_key, cached, shared_lm
from fedfm.models.causal_lm import LMBundle
from fedfm.models.encoders import Encoder, lm_encoder
from fedfm.models.features import Pool
from fedfm.models.generation import GenerationConfig, Reply, generate_replies, pad_id_of
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

if TYPE_CHECKING:
    from fedfm.core.dp import DPResult, DPSGDConfig
    from fedfm.core.state import ClientState

Arrays = dict[str, Tensor]


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


class FoundationModel:
    """A handle on a shared frozen causal LM with named LoRA adapters.

    Cheap to build: the base is loaded on first use. Handles on the same base share its
    adapters; ``lora``, ``prompt`` and ``autocast_bf16`` are this handle's defaults for new
    adapters, prompt fitting and forward passes.

    Args:
        name: A causal LM of the model registry (``smollm2-135m-instruct``, ``tiny-llama``, ...).
        dtype: Dtype of the frozen base weights.
        args: Arguments of the model builder.
        lora: LoRA hyper-parameters of adapters created without their own spec.
        prompt: Prompt formatting and length limits.
        autocast_bf16: Run forward passes (generation, features, DP-SGD) under bfloat16
            autocast; where a GPU lacks bfloat16, float16 (DP-SGD: none); where a CPU
            lacks it, none.
        quantization: ``4bit`` or ``8bit``: the base is loaded quantised (see
            :func:`fedfm.fm.bases.shared_base`).
        device: Where the base lives and computes (the CPU when ``None``); every handle on
            the same base and device shares it.
    """

    def __init__(
        self,
        name: str,
        dtype: str = "float32",
        args: Mapping[str, Any] | None = None,
        *,
        lora: LoraConfigSpec | None = None,
        prompt: PromptConfig | None = None,
        autocast_bf16: bool = False,
        quantization: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.args = dict(args or {})
        self.lora = lora or LoraConfigSpec()
        self.prompt_cfg = prompt or PromptConfig()
        self.autocast_bf16 = autocast_bf16
        self.quantization = quantization
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.key = base_key(name, dtype, self.args, quantization, self.device)

    # ----- the shared model -----
    @property
    def bundle(self) -> LMBundle:
        """The frozen base model and its tokenizer (loaded on first use)."""
        return self._entry().bundle

    def _entry(self) -> SharedLM:
        """This handle's entry of the process cache (loaded on first use)."""
        return shared_lm(self.name, self.dtype, self.args, self.quantization, self.device)

    def _adapted(self) -> peft.PeftModel | None:
        """The shared ``PeftModel`` once an adapter exists (nothing is loaded here)."""
        entry = cached(self.key)
        return entry.adapted if entry is not None else None

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (right padding, a pad token set)."""
        return self.bundle.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The shared ``PeftModel``, or the bare base while no adapter exists yet.

        Adapters are as last chosen; prefer :meth:`use` to choose them for a block of code.
        """
        model = self._adapted()
        return model if model is not None else self.bundle.model

    @property
    def num_layers(self) -> int:
        """Decoder layers of the base (features have ``num_layers + 1`` entries)."""
        return int(self.bundle.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return int(self.bundle.model.config.hidden_size)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast on the model's device when ``autocast_bf16``: bfloat16 where the device
        computes it natively, else float16 on a GPU and none on a CPU
        (:func:`fedfm.devices.autocast`); else a no-op."""
        return autocast(model_device(self.bundle.model), self.autocast_bf16)

    def dp_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """:meth:`autocast` without the float16 fallback: DP-SGD clips per-sample gradients,
        which float16's loss scaling would scale."""
        return autocast(model_device(self.bundle.model), self.autocast_bf16, half=False)

    # ----- adapters -----
    def adapters(self) -> list[str]:
        """Every adapter on the shared model, in creation order (a reset one moves last)."""
        model = self._adapted()
        return adapter_names(model) if model is not None else []

    def has_adapter(self, name: str) -> bool:
        """Whether adapter ``name`` exists."""
        return name in self.adapters()

    @property
    def active(self) -> list[str]:
        """Adapters used in the forward pass now."""
        model = self._adapted()
        return active_adapters(model) if model is not None else []

    @property
    def trainable(self) -> list[str]:
        """Adapters whose tensors receive gradients now."""
        model = self._adapted()
        return trainable_adapters(model) if model is not None else []

    def add_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
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
        model = self._adapted()
        # Ordinary tensors even inside a no-grad handler (inference mode), or training the
        # adapter later would fail.
        with torch.inference_mode(False):
            if model is None:
                entry = self._entry()
                entry.adapted = add_adapters(entry.bundle.model, [name], spec, seed=seed)
                set_active(entry.adapted, [], [])
                return
            keep = (self.active, self.trainable)
            add_adapters(model, [name], spec, seed=seed)
            # peft re-enables gradients of every active adapter it adds one to: restore them.
            set_active(model, *keep)

    def ensure_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> bool:
        """Creates adapter ``name`` (see :meth:`add_adapter`) unless it exists.

        Returns:
            Whether it was created.
        """
        if self.has_adapter(name):
            return False
        self.add_adapter(name, seed, lora)
        return True

    def reset_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
        """Gives adapter ``name`` a fresh seeded init (created when missing).

        The result equals a first :meth:`add_adapter` with this seed and spec. Whether it is
        active or trainable is kept.
        """
        if not self.has_adapter(name):
            self.add_adapter(name, seed, lora)
            return
        active, trainable = self.active, self.trainable
        self.delete_adapter(name)
        self.add_adapter(name, seed, lora)
        self.set_active(active, trainable)

    def delete_adapter(self, name: str) -> None:
        """Removes adapter ``name``; the others keep their tensors and status.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        model = self._peft([name])
        active = [a for a in self.active if a != name]
        trainable = [a for a in self.trainable if a != name]
        with warnings.catch_warnings():  # peft warns that it picks a new active adapter; we do
            warnings.simplefilter("ignore", UserWarning)
            model.delete_adapter(name)
        if adapter_names(model):
            set_active(model, active, trainable)

    def set_active(self, active: Sequence[str], trainable: Sequence[str] = ()) -> None:
        """Chooses the adapters of the forward pass and those that receive gradients.

        Args:
            active: Adapters whose deltas are added in the forward pass; ``[]``: the base.
            trainable: A subset of ``active``; every other parameter is frozen.

        Raises:
            UnknownNameError: A name is not an adapter (field ``lora.adapter``).
            ConfigError: ``trainable`` is not a subset of ``active`` (field ``lora.trainable``).
        """
        active, trainable = list(active), list(trainable)
        if not active and not trainable and self._adapted() is None:
            return  # the bare base is already what was asked for
        set_active(self._peft([*active, *trainable]), active, trainable)

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
        self.set_active(active, trainable)
        try:
            yield self.model
        finally:
            if self._adapted() is not None:
                self.set_active(*before)

    def get_adapter(self, name: str) -> Arrays:
        """Detached CPU copies of adapter ``name``'s tensors; keys do not name the adapter.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        return get_adapter_state(self._peft([name]), name)

    def set_adapter(self, name: str, state: Mapping[str, Tensor]) -> None:
        """Copies ``state`` (from :meth:`get_adapter` of any same-shaped adapter) into ``name``.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
            AdapterStateError: Keys or shapes differ.
        """
        set_adapter_state(self._peft([name]), name, dict(state))

    def get_adapters(self, names: Sequence[str]) -> dict[str, Arrays]:
        """``{name: get_adapter(name)}``: one message array field per adapter."""
        return {name: self.get_adapter(name) for name in names}

    def param_names(self, name: str) -> dict[str, str]:
        """Key of each of adapter ``name``'s tensors (as :meth:`get_adapter` gives them) ->
        its parameter name in :attr:`model`, for training loops that find tensors by name.

        Raises:
            UnknownNameError: No such adapter (field ``lora.adapter``).
        """
        return adapter_param_names(self._peft([name]), name)

    def save_adapter(self, name: str, folder: str | Path) -> Path:
        """Writes adapter ``name`` in peft's format into ``folder``
        (``adapter_config.json``, ``adapter_model.safetensors``): plain peft loads it with
        ``PeftModel.from_pretrained(base, folder)``, :meth:`read_adapter` into any handle."""
        return save_adapter(self._peft([name]), name, folder)

    def read_adapter(self, name: str, folder: str | Path) -> None:
        """Loads a peft adapter folder (from :meth:`save_adapter`) as adapter ``name``,
        replacing its tensors when it exists (see :func:`fedfm.models.lora.load_adapter`).

        Raises:
            AssetMissingError: ``folder`` holds no peft adapter.
        """
        if self._adapted() is None:  # peft needs one adapter to wrap the base
            self.ensure_adapter(name, seed=0)
        load_adapter(self._peft([]), name, folder)

    def load_adapter(
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
            self.ensure_adapter(name, seed, lora)
            self.set_adapter(name, state)
        else:
            self.reset_adapter(name, seed, lora)

    @contextlib.contextmanager
    def slot(
        self,
        name: str,
        state: Mapping[str, Tensor] | None,
        seed: int = 0,
        lora: LoraConfigSpec | None = None,
    ) -> Iterator[None]:
        """Within the block adapter ``name`` holds ``state``, or a fresh seeded init when
        ``state`` is empty (see :meth:`load_adapter`); on exit it holds what it held before.

        The way a handler or a server step reads or trains an adapter: the slot is shared by
        every simulated client and run of the process, so what it holds outside a block is
        nobody's. A slot the block created stays (peft keeps its layers), with the block's
        tensors. Blocks nest (a client's inside the server's, one slot per adapter).
        """
        before = self.get_adapter(name) if self.has_adapter(name) else None
        self.load_adapter(name, state, seed, lora)
        try:
            yield
        finally:
            now = self.get_adapter(name) if before is not None else {}
            if before is not None and all(
                k in now and now[k].shape == v.shape for k, v in before.items()
            ):
                self.set_adapter(name, before)

    # ----- prompts and generation -----
    def prompt(
        self,
        template: str,
        fields: Mapping[str, str] | None = None,
        *,
        system: str | None = None,
        cut: Sequence[str] = (),
    ) -> str:
        """A chat prompt whose user turn is ``template.format(**fields)``, ready for the reply.

        Too long for ``prompt.max_prompt_length``, it loses tokens from the middle of the
        fields named in ``cut`` (in that order), never from the template's text or its end
        (see :func:`fedfm.data.prompt.fit_template`). ``system=None`` uses the prompt
        config's system message, else the chat template's default.
        """
        return fit_template(self.tokenizer, template, fields or {}, self.prompt_cfg, system, cut)[0]

    def full_prompt(
        self, template: str, fields: Mapping[str, str] | None = None, *, system: str | None = None
    ) -> tuple[str, int]:
        """The prompt :meth:`prompt` makes, never cut, and its length in tokens: for callers
        that give a long prompt the room it needs or leave the row out, rather than reading
        text with its middle missing."""
        user = template.format(**(fields or {}))
        text = chat_prompt(self.tokenizer, user, system, self.prompt_cfg)
        return text, len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def context_length(self) -> int:
        """Tokens the base model attends over (``max_position_embeddings`` of its config)."""
        return int(self.bundle.model.config.max_position_embeddings)

    def instruction_prompt(self, instruction: str, input: str = "") -> str:
        """The prompt of an instruction row exactly as in training and evaluation."""
        return fit_prompt(self.tokenizer, instruction, input, self.prompt_cfg)[0]

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        adapters: Sequence[str],
        *,
        seed: int,
        cfg: GenerationConfig | None = None,
        **overrides: Any,
    ) -> list[str]:
        """Replies to complete prompts with the ``adapters`` active, batched, under autocast.

        Args:
            prompts: Complete prompt strings (from :meth:`prompt` or
                :meth:`instruction_prompt`) or token id lists.
            adapters: Adapters active while generating (``[]``: the base model).
            seed: Seeds sampling without touching the global RNG; derive it with
                :func:`fedfm.core.seeding.derive_seed` (e.g. ``ctx.rng_seed("rewrite")``).
                The same prompts, seed and batch size give the same text.
            cfg: Decoding settings; greedy, 64 new tokens, batches of 16 by default.
            **overrides: Fields of ``cfg`` to change for this call (``do_sample=True``, ...).

        Returns:
            One reply per prompt, in order: the new tokens up to the first end-of-turn token,
            special tokens removed, whitespace stripped.
        """
        replies = self.generate_replies(prompts, adapters, seed=seed, cfg=cfg, **overrides)
        return [r.text for r in replies]

    def generate_replies(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        adapters: Sequence[str],
        *,
        seed: int,
        cfg: GenerationConfig | None = None,
        **overrides: Any,
    ) -> list[Reply]:
        """:meth:`generate` with, for each reply, whether it ran into ``max_new_tokens``
        (:class:`fedfm.models.generation.Reply`)."""
        base = (cfg or GenerationConfig()).model_dump()
        cfg = validate_section(GenerationConfig, {**base, **overrides}, "generate")
        with self.use(adapters) as model, self.autocast():
            return generate_replies(
                model,
                self.tokenizer,
                prompts,
                cfg.max_new_tokens,
                cfg.batch_size,
                self.prompt_cfg,
                seed=seed,
                **cfg.generate_kwargs(),
            )

    # ----- features -----
    def features(
        self,
        texts: Sequence[str] | Sequence[Sequence[int]],
        adapters: Sequence[str],
        *,
        layers: Sequence[int] | None = None,
        batch_size: int = 16,
        pool: Pool = "last",
        max_length: int | None = None,
    ) -> Tensor:
        """Hidden states of every layer (embedding output first) with ``adapters`` active.

        Args:
            texts: Complete texts (tokenised without added special tokens) or token ids.
            adapters: Adapters active in the forward pass (``[]``: the base model).
            layers: Hidden states to keep, ``0..num_layers`` (negative from the end); all
                ``num_layers + 1`` when ``None``.
            batch_size: Texts per forward pass (right-padded; results equal batch size 1).
            pool: ``"last"`` non-padding token (FedHDS) or ``"mean"`` over tokens.
            max_length: Keep only each text's last ``max_length`` tokens.

        Returns:
            ``(len(texts), len(layers), hidden_size)`` float32 CPU tensor. The LM head is not
            computed; the last hidden state is taken after the final norm, as in transformers.

        Raises:
            ConfigError: A layer index is out of range (field ``features.layers``).
        """
        view = self.feature_view(adapters, max_length)
        return view.layer_features(texts, layers, batch_size, pool)

    def feature_view(self, adapters: Sequence[str], max_length: int | None = None) -> Encoder:
        """This model with ``adapters`` active as an encoder with per-layer features
        (:class:`fedfm.models.encoders.Encoder`), so that code written for a separate small
        feature model (FedHDS-Turbo) runs on the LLM unchanged."""
        active = list(adapters)
        # The backbone object stays the same when peft wraps the base: LoRA layers go inside.
        return lm_encoder(
            f"{self.name} with adapters {active}", self.model, self.tokenizer, max_length,
            self.autocast, scope=lambda: self.use(active),
        )  # fmt: skip

    # ----- training data -----
    def encode(self, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, list[int]]]:
        """Token ids, masks and response-only labels of ``instruction, input, output`` rows,
        exactly as in training (rows with an empty ``output`` are dropped)."""
        return [
            enc
            for row in rows
            if (
                enc := encode_example(
                    self.tokenizer,
                    row["instruction"],
                    row.get("input") or "",
                    row["output"],
                    self.prompt_cfg,
                )
            )
            is not None
        ]

    # ----- all weights (full fine-tuning) -----
    def _base_params(self) -> dict[str, torch.nn.Parameter]:
        """The base's own parameters by canonical name (tied tensors once, no LoRA tensor).

        peft puts LoRA wrappers inside the base (``q_proj`` becomes ``q_proj.base_layer`` once
        an adapter exists in the process), so the ``base_layer`` segment is dropped: names do
        not depend on whether some run of this process created an adapter.
        """
        out: dict[str, torch.nn.Parameter] = {}
        for name, param in self.bundle.model.named_parameters():
            parts = name.split(".")
            if any(part.startswith("lora_") for part in parts):
                continue
            out[".".join(part for part in parts if part != "base_layer")] = param
        return out

    def get_weights(self) -> Arrays:
        """Detached CPU copies of every base weight (what full fine-tuning trains)."""
        return {n: p.detach().cpu().clone() for n, p in self._base_params().items()}

    @contextlib.contextmanager
    def full_weights(
        self, state: Mapping[str, Tensor], trainable: bool = False
    ) -> Iterator[torch.nn.Module]:
        """Within the block the base carries ``state`` (from :meth:`get_weights`), no adapter
        is active, and every base weight gets gradients when ``trainable``.

        The base is shared by every handle and run of the process, so its own weights and
        frozen flags come back on exit, whatever happens.

        Raises:
            ConfigError: ``state`` has other names or shapes than the base (field
                ``weights``).
        """
        params = self._base_params()
        if set(state) != set(params) or any(
            tuple(state[n].shape) != tuple(p.shape) for n, p in params.items()
        ):
            raise ConfigError("weights", "the weights do not match the base model's parameters")
        own = {n: p.detach().clone() for n, p in params.items()}
        with self.use([]) as model:
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

    # ----- DP-SGD -----
    def dp_train(
        self,
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
            rows: Encoded rows of this client (:meth:`encode`).
            state: The client's persistent state; its account lives under ``state.meta[key]``.
            what: :class:`Adapters` (the trainable adapters, with the active ones in the
                forward pass) or :class:`FullWeights` (every base weight, starting from the
                given ones; no adapter active).
            train, dp, delta, steps, planned_steps, seed, key, field: See
                :func:`fedfm.core.dp.dp_train` (the accounting included).

        Returns:
            The DP result and the trained tensors: the trainable adapter's (one adapter: its
            :meth:`get_adapter`; several: grouped by name, ``"<adapter>/<key>"``), or every
            weight (:meth:`get_weights`).
        """
        from fedfm.core.dp import dp_train  # Opacus is imported only by runs that use it

        with self._training(what) as model:
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
                pad_id=pad_id_of(self.tokenizer),
                autocast=self.dp_autocast,
                key=key,
                field=field,
            )
            return res, self._trained(what)

    def _training(self, what: Adapters | FullWeights) -> contextlib.AbstractContextManager[Any]:
        """The model to train ``what`` in (see :meth:`dp_train`)."""
        if isinstance(what, FullWeights):
            return self.full_weights(what.weights, trainable=True)
        if what.frozen:
            return self._use_frozen(what)
        return self.use(what.active, what.trainable)

    @contextlib.contextmanager
    def _use_frozen(self, what: Adapters) -> Iterator[torch.nn.Module]:
        """:meth:`use`, with ``what.frozen`` out of training (restored on exit by :meth:`use`)."""
        with self.use(what.active, what.trainable) as model:
            names = self.param_names(what.trainable[0])
            live = dict(model.named_parameters())
            for key in what.frozen:
                live[names[key]].requires_grad_(False)
            yield model

    def _trained(self, what: Adapters | FullWeights) -> Arrays:
        """Copies of the tensors ``what`` trained, in the one key format."""
        if isinstance(what, FullWeights):
            return self.get_weights()
        if len(what.trainable) == 1:
            return self.get_adapter(what.trainable[0])
        return join_groups(self.get_adapters(what.trainable))

    def _peft(self, names: Sequence[str]) -> peft.PeftModel:
        """The shared PeftModel; an unknown adapter name is one line naming the field."""
        model = self._adapted()
        have = adapter_names(model) if model is not None else []
        for name in names:
            if name not in have:
                listed = ", ".join(have) or "none"
                raise UnknownNameError("lora.adapter", f"unknown adapter '{name}' (have {listed})")
        if model is None:
            raise ConfigError("lora.adapter", "the model has no adapters yet")
        return model
