"""The :class:`FoundationModel` handle.

A façade over a shared base of :mod:`fedfm.fm.bases`, its adapter slots
(:mod:`fedfm.fm.adapters`) and training (:mod:`fedfm.fm.training`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedfm.config import TrainConfig, validate_section
from fedfm.data.prompt import (
    PromptConfig,
    chat_prompt,
    encode_example,
    fit_prompt,
    fit_template,
)
from fedfm.devices import autocast, autocast_in_effect, model_device
from fedfm.fm import training
from fedfm.fm.adapters import AdapterSlots
from fedfm.fm.bases import SharedLM, base_key, shared_lm
from fedfm.fm.training import Adapters, FullWeights
from fedfm.models.cast_once import cast_frozen_linears, release_file_weights
from fedfm.models.causal_lm import LMBundle
from fedfm.models.encoders import Encoder, lm_encoder
from fedfm.models.features import Pool
from fedfm.models.generation import GenerationConfig, Reply, generate_replies
from fedfm.models.lora import LoraConfigSpec

if TYPE_CHECKING:
    from fedfm.core.dp import DPResult, DPSGDConfig
    from fedfm.core.state import ClientState

Arrays = dict[str, Tensor]

__all__ = ["Adapters", "FoundationModel", "FullWeights"]


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
        self.slots = AdapterSlots(self.key, self._entry, self.lora)
        """The adapters of the shared base (every handle on it sees the same)."""

    # ----- the shared model -----
    @property
    def bundle(self) -> LMBundle:
        """The frozen base model and its tokenizer (loaded on first use)."""
        return self._entry().bundle

    def _entry(self) -> SharedLM:
        """This handle's entry of the process cache (loaded on first use).

        Under autocast its frozen linear weights are also kept cast to the autocast dtype
        (:mod:`fedfm.models.cast_once`), once per base and dtype.
        """
        entry = shared_lm(self.name, self.dtype, self.args, self.quantization, self.device)
        dtype = autocast_in_effect(self.device, self.autocast_bf16)
        if dtype is not None and self.quantization is None and dtype not in entry.cast:
            cast_frozen_linears(entry.bundle.model, dtype)
            release_file_weights(entry.bundle.model)  # float32 pages: read from the file if needed
            entry.cast.add(dtype)
        return entry

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (right padding, a pad token set)."""
        return self.bundle.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The shared ``PeftModel``, or the bare base while no adapter exists yet.

        Adapters are as last chosen; prefer :meth:`use` to choose them for a block of code.
        """
        return self.slots.model

    @property
    def num_layers(self) -> int:
        """Decoder layers of the base (features have ``num_layers + 1`` entries)."""
        return int(self.bundle.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return int(self.bundle.model.config.hidden_size)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast on the model's device when ``autocast_bf16``, else a no-op.

        bfloat16 where the device computes it natively, else float16 on a GPU and none on a CPU
        (:func:`fedfm.devices.autocast`).
        """
        return autocast(model_device(self.bundle.model), self.autocast_bf16)

    def dp_autocast(self) -> contextlib.AbstractContextManager[Any]:
        """:meth:`autocast` without the float16 fallback.

        DP-SGD clips per-sample gradients, which float16's loss scaling would scale.
        """
        return autocast(model_device(self.bundle.model), self.autocast_bf16, half=False)

    # ----- adapters (fedfm.fm.adapters.AdapterSlots) -----
    def adapters(self) -> list[str]:
        """Every adapter on the shared model, in creation order (a reset one moves last)."""
        return self.slots.names()

    def has_adapter(self, name: str) -> bool:
        """Whether adapter ``name`` exists."""
        return self.slots.has(name)

    @property
    def active(self) -> list[str]:
        """Adapters used in the forward pass now."""
        return self.slots.active

    @property
    def trainable(self) -> list[str]:
        """Adapters whose tensors receive gradients now."""
        return self.slots.trainable

    def add_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
        """Creates adapter ``name``, inactive and frozen (:meth:`AdapterSlots.add`)."""
        self.slots.add(name, seed, lora)

    def ensure_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> bool:
        """Creates adapter ``name`` unless it exists, and returns whether it did.

        See :meth:`AdapterSlots.ensure`.
        """
        return self.slots.ensure(name, seed, lora)

    def reset_adapter(self, name: str, seed: int, lora: LoraConfigSpec | None = None) -> None:
        """Gives adapter ``name`` a fresh seeded init (:meth:`AdapterSlots.reset`)."""
        self.slots.reset(name, seed, lora)

    def delete_adapter(self, name: str) -> None:
        """Removes adapter ``name`` (:meth:`AdapterSlots.delete`)."""
        self.slots.delete(name)

    def set_active(self, active: Sequence[str], trainable: Sequence[str] = ()) -> None:
        """Chooses the adapters of the forward pass and those that receive gradients.

        See :meth:`AdapterSlots.choose`.
        """
        self.slots.choose(active, trainable)

    def use(
        self, active: Sequence[str], trainable: Sequence[str] = ()
    ) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Within the block ``active`` adapters are used and ``trainable`` ones get gradients.

        Yields the model to call (:meth:`AdapterSlots.use`).
        """
        return self.slots.use(active, trainable)

    def slot(
        self,
        name: str,
        state: Mapping[str, Tensor] | None,
        seed: int = 0,
        lora: LoraConfigSpec | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Within the block adapter ``name`` holds ``state``; on exit what it held before.

        An empty ``state`` gives a seeded init. How code reads or trains an adapter
        (:meth:`AdapterSlots.slot`).
        """
        return self.slots.slot(name, state, seed, lora)

    def get_adapter(self, name: str) -> Arrays:
        """Detached CPU copies of adapter ``name``'s tensors (:meth:`AdapterSlots.get`)."""
        return self.slots.get(name)

    def set_adapter(self, name: str, state: Mapping[str, Tensor]) -> None:
        """Copies ``state`` into adapter ``name`` (:meth:`AdapterSlots.put`)."""
        self.slots.put(name, state)

    def get_adapters(self, names: Sequence[str]) -> dict[str, Arrays]:
        """``{name: get_adapter(name)}``: one message array field per adapter."""
        return self.slots.get_many(names)

    def param_names(self, name: str) -> dict[str, str]:
        """Key of each of adapter ``name``'s tensors -> its parameter name in :attr:`model`.

        See :meth:`AdapterSlots.param_names`.
        """
        return self.slots.param_names(name)

    def save_adapter(self, name: str, folder: str | Path) -> Path:
        """Writes adapter ``name`` in peft's format into ``folder`` (:meth:`AdapterSlots.save`)."""
        return self.slots.save(name, folder)

    def read_adapter(self, name: str, folder: str | Path) -> None:
        """Loads a peft adapter folder as adapter ``name`` (:meth:`AdapterSlots.read`)."""
        self.slots.read(name, folder)

    def load_adapter(
        self,
        name: str,
        state: Mapping[str, Tensor] | None,
        seed: int,
        lora: LoraConfigSpec | None = None,
    ) -> None:
        """Puts ``state`` into adapter ``name`` without restoring it later.

        An empty ``state`` gives a fresh seeded init (:meth:`AdapterSlots.load`; prefer
        :meth:`slot`).
        """
        self.slots.load(name, state, seed, lora)

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
        """The prompt :meth:`prompt` makes, never cut, and its length in tokens.

        For callers that give a long prompt the room it needs or leave the row out, rather than
        reading text with its middle missing.
        """
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
        """:meth:`generate` with, for each reply, whether it ran into ``max_new_tokens``.

        See :class:`fedfm.models.generation.Reply`.
        """
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
        pool: Pool | None = None,
        max_length: int | None = None,
    ) -> Tensor:
        """Hidden states of every layer (embedding output first) with ``adapters`` active.

        Args:
            texts: Complete texts (tokenised without added special tokens) or token ids.
            adapters: Adapters active in the forward pass (``[]``: the base model).
            layers: Hidden states to keep, ``0..num_layers`` (negative from the end); all
                ``num_layers + 1`` when ``None``.
            batch_size: Texts per forward pass (right-padded; results equal batch size 1).
            pool: ``"last"`` non-padding token (FedHDS) or ``"mean"`` over tokens; ``None``:
                the causal LM's own, the last token.
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
        """This model with ``adapters`` active as an encoder with per-layer features.

        The encoder is a :class:`fedfm.models.encoders.Encoder`, so that code written for a separate
        small feature model (FedHDS-Turbo) runs on the LLM unchanged.
        """
        active = list(adapters)
        # The backbone object stays the same when peft wraps the base: LoRA layers go inside.
        return lm_encoder(
            f"{self.name} with adapters {active}", self.model, self.tokenizer, max_length,
            self.autocast, scope=lambda: self.use(active),
        )  # fmt: skip

    # ----- training data -----
    def encode(self, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, list[int]]]:
        """Token ids, masks and response-only labels of ``instruction, input, output`` rows.

        Encoded exactly as in training (rows with an empty ``output`` are dropped).
        """
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

    # ----- all weights and DP-SGD (fedfm.fm.training) -----
    def get_weights(self) -> Arrays:
        """Detached CPU copies of every base weight (:func:`fedfm.fm.training.get_weights`)."""
        return training.get_weights(self)

    def full_weights(
        self, state: Mapping[str, Tensor], trainable: bool = False
    ) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Within the block the base carries ``state``, no adapter active.

        Its own weights come back on exit (:func:`fedfm.fm.training.full_weights`).
        """
        return training.full_weights(self, state, trainable)

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
        """DP-SGD (Opacus) on adapters or on every base weight.

        Returns the DP result and the trained tensors (:func:`fedfm.fm.training.dp_train`).
        """
        return training.dp_train(
            self, rows, state, what, train=train, dp=dp, delta=delta, steps=steps,
            planned_steps=planned_steps, seed=seed, key=key, field=field,
        )  # fmt: skip
