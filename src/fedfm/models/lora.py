"""Several named LoRA adapters on one frozen base model, through peft.

LoRA: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (ICLR 2022): a frozen linear
layer ``W0`` becomes ``W0 x + (alpha / r) B A x`` with trainable ``A`` (r x in) and ``B`` (out x r),
``B`` initialised to zero so that a new adapter leaves the model unchanged.

Federated methods keep more than one adapter on the same base (a global and a local one in FedSDR,
a global adapter and its rectified copy, per-client private adapters), with any subset active in
the forward pass and any subset trainable. peft does all of this; the functions here give it one
small, strict interface:

- adapters are added, activated and frozen by name (:func:`add_adapters`, :func:`set_active`);
- adapters are saved in peft's own format: ``PeftModel.from_pretrained(base, folder)`` loads them.

One key format for adapter tensors wherever they leave a model (messages, client states,
checkpoints, the exported adapter): peft's saved keys, which do not name the adapter
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so a state taken from
adapter ``"global"`` loads into adapter ``"rectified"`` or into plain peft
(:func:`get_adapter_state`, :func:`set_adapter_state`). Several adapters in one flat dict are
grouped by adapter name, ``"<adapter>/<saved key>"`` (:func:`fedfm.core.groups.join_groups`;
:func:`trainable_state`). The base model is never saved or sent.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import peft
import pydantic
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict
from torch import Tensor, nn

from fedfm.core.groups import join_groups
from fedfm.core.lora_ranks import RANK_MODES
from fedfm.errors import AssetMissingError, ConfigError, FedfmError, UnknownNameError


class AdapterStateError(FedfmError, ValueError):
    """An adapter state does not fit the adapter: unknown or missing keys, or wrong shapes."""


AUTO = "auto"
ALL_LINEAR = "all-linear"


class LoraConfigSpec(pydantic.BaseModel):
    """LoRA hyper-parameters shared by every adapter of a run.

    Attributes:
        r: Rank of ``A`` and ``B``.
        alpha: Scale numerator; the update is scaled by ``alpha / r``.
        dropout: Dropout on the adapter input, active in train mode only.
        target_modules: Names of the linear layers to adapt (suffixes of module names);
            ``auto``: the architecture's attention projections as peft's own defaults name
            them (``q_proj, v_proj`` for Llama, Qwen2, Gemma; :func:`auto_targets`);
            ``all-linear``: every linear layer except the output head (QLoRA's choice).
        use_dora: DoRA (Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", ICML 2024):
            each adapted weight is split into a magnitude vector and a direction that LoRA
            updates; the magnitude is one more trainable adapter tensor per layer.
        rank_mode: How adapters of different client ranks are aggregated
            (:data:`fedfm.core.lora_ranks.RANK_MODES`: ``svd``, ``hetlora``, ``zeropad``,
            ``flora``); used with ``client_ranks``.
        client_ranks: Each client's LoRA rank, by client tier: client ``i`` (in the task's
            client order) has ``client_ranks[i mod len]``; None: every client has ``r``, the
            global rank. See :mod:`fedfm.algorithms.lora_clients`.
        freeze_a: FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated
            Learning", ICLR 2024): ``A`` is drawn from the run seed and frozen; only ``B`` is
            trained, sent and aggregated.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    r: int = pydantic.Field(8, gt=0)
    alpha: float = pydantic.Field(16.0, gt=0)
    dropout: float = pydantic.Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["auto", "all-linear"] = pydantic.Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    use_dora: bool = False
    rank_mode: str = "svd"
    client_ranks: list[pydantic.PositiveInt] | None = pydantic.Field(None, min_length=1)
    freeze_a: bool = False

    @pydantic.field_validator("rank_mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v not in RANK_MODES:
            raise ValueError(f"unknown rank mode '{v}' (choose from {', '.join(RANK_MODES)})")
        return v

    @pydantic.field_validator("client_ranks")
    @classmethod
    def _within_global(cls, v: list[int] | None, info: pydantic.ValidationInfo) -> list[int] | None:
        mode, r = info.data.get("rank_mode"), info.data.get("r")
        if v is None or mode is None or r is None:
            return v
        if RANK_MODES.get(mode).caps_rank and max(v) > r:
            raise ValueError(
                f"client rank {max(v)} is above the global rank r={r}, which rank_mode"
                f" '{mode}' projects or pads every client to"
            )
        return v

    @pydantic.field_validator("freeze_a")
    @classmethod
    def _one_rank(cls, v: bool, info: pydantic.ValidationInfo) -> bool:
        ranks, r = info.data.get("client_ranks"), info.data.get("r")
        if v and ranks is not None and r is not None and set(ranks) != {r}:
            raise ValueError(
                f"needs every client at the global rank r={r} (client_ranks {ranks}): one"
                " frozen A is shared by the server and every client, so every B has its rank"
            )
        if v and info.data.get("use_dora"):
            raise ValueError("FFA-LoRA freezes A of plain LoRA; use_dora adds a trained magnitude")
        return v

    @property
    def mixed(self) -> bool:
        """Clients hold different ranks (or a rank other than the global one)."""
        return self.client_ranks is not None and set(self.client_ranks) != {self.r}

    @pydantic.field_validator("target_modules", mode="before")
    @classmethod
    def _names_or_keyword(cls, v: object) -> object:
        if isinstance(v, str) and v not in (AUTO, ALL_LINEAR):
            raise ValueError(f"must be a list of module names, '{AUTO}' or '{ALL_LINEAR}'")
        return v

    def targets(self, model_type: str | None) -> list[str] | str:
        """The ``target_modules`` peft gets for a model of ``model_type`` (``auto`` resolved).

        Raises:
            ConfigError: ``auto`` for an architecture peft has no defaults for (field
                ``task.lora.target_modules``).
        """
        if self.target_modules == AUTO:
            return auto_targets(model_type)
        if self.target_modules == ALL_LINEAR:
            return ALL_LINEAR
        return list(self.target_modules)

    def to_peft(
        self, task_type: str | None = None, model_type: str | None = None
    ) -> peft.LoraConfig:
        """The equivalent ``peft.LoraConfig`` (peft's default init: ``B = 0``)."""
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # peft reads a float scale too
            lora_dropout=self.dropout,
            target_modules=self.targets(model_type),
            use_dora=self.use_dora,
            task_type=task_type,
        )


def auto_targets(model_type: str | None) -> list[str]:
    """The LoRA targets peft uses by default for an architecture (its attention projections).

    Read from peft's own table (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), the
    one ``peft.LoraConfig(target_modules=None)`` consults, so fedfm adapts what peft would.

    Raises:
        ConfigError: peft has no entry for ``model_type`` (field ``task.lora.target_modules``).
    """
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as KNOWN

    if model_type is None or model_type not in KNOWN:
        raise ConfigError(
            "task.lora.target_modules",
            f"'auto' knows no LoRA targets for architecture {model_type!r}; list the linear"
            " layers to adapt (e.g. [q_proj, v_proj]) or use all-linear",
        )
    return list(KNOWN[model_type])


def model_type_of(model: nn.Module) -> str | None:
    """The transformers ``model_type`` of a model or of the base inside a ``PeftModel``."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def add_adapters(
    model: nn.Module, names: list[str], spec: LoraConfigSpec, seed: int | None = None
) -> peft.PeftModel:
    """Adds one LoRA adapter per name, all on the same frozen base.

    Args:
        model: A base model (wrapped in place by peft) or a ``PeftModel`` to extend.
        names: New adapter names; unique, without dots, not already present.
        spec: LoRA hyper-parameters of the new adapters.
        seed: Seeds the random init of the ``A`` matrices without touching the global RNG;
            ``None`` draws from the global RNG.

    Returns:
        The ``PeftModel`` (a ``PeftModelForCausalLM`` when ``model`` can generate), with exactly
        the new adapters active and trainable and every base parameter frozen.

    Raises:
        ConfigError: ``names`` is empty, repeats a name, has a dotted name or an existing one.
    """
    if not names:
        raise ConfigError("lora.adapters", "at least one adapter name is needed")
    if len(set(names)) != len(names):
        raise ConfigError("lora.adapters", f"adapter names repeat: {names}")
    existing = set(model.peft_config) if isinstance(model, peft.PeftModel) else set()
    for name in names:
        if not name or "." in name:
            raise ConfigError("lora.adapters", f"adapter name {name!r} must be non-empty, no dots")
        if name in existing:
            raise ConfigError("lora.adapters", f"adapter '{name}' already exists")
    can_generate = getattr(model, "can_generate", lambda: False)()
    config = spec.to_peft("CAUSAL_LM" if can_generate else None, model_type_of(model))
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        if isinstance(model, peft.PeftModel):
            peft_model = model
        else:
            with warnings.catch_warnings():
                # peft 0.21 probes transformers 5's deprecated alias (a FutureWarning per call).
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
                peft_model = peft.get_peft_model(model, config, adapter_name=names[0])
        for name in names:
            if name not in peft_model.peft_config:
                peft_model.add_adapter(name, config)
    set_active(peft_model, active=list(names), trainable=list(names))
    return peft_model


def adapter_names(peft_model: peft.PeftModel) -> list[str]:
    """Names of every adapter on the model, in the order they were added."""
    return list(peft_model.peft_config)


def set_active(peft_model: peft.PeftModel, active: list[str], trainable: list[str]) -> None:
    """Chooses which adapters take part in the forward pass and which receive gradients.

    Args:
        peft_model: The model.
        active: Adapters used in the forward pass (their deltas add up); ``[]`` gives the base.
        trainable: Adapters whose tensors get ``requires_grad=True``; a subset of ``active``,
            since an inactive adapter would receive no gradient.

    Raises:
        UnknownNameError: A name is not an adapter of the model.
        ConfigError: ``trainable`` is not a subset of ``active``.
    """
    for name in [*active, *trainable]:
        _check_adapter(peft_model, name)
    if not set(trainable) <= set(active):
        idle = sorted(set(trainable) - set(active))
        raise ConfigError("lora.trainable", f"adapters {idle} are trainable but not active")
    # The outer PeftModel.set_adapter refuses a list; the tuner underneath accepts one. It also
    # makes every active adapter trainable, so freeze the others afterwards.
    tuner: Any = peft_model.base_model
    tuner.set_adapter(list(active))
    frozen = [name for name in active if name not in trainable]
    if frozen:
        tuner.set_requires_grad(frozen, requires_grad=False)
    adapter_params = _adapter_param_ids(peft_model)
    for param in peft_model.parameters():
        if id(param) not in adapter_params:
            param.requires_grad_(False)  # the base stays frozen whatever peft did


def active_adapters(peft_model: peft.PeftModel) -> list[str]:
    """Adapters currently used in the forward pass."""
    tuner: Any = peft_model.base_model
    active = tuner.active_adapter
    return [active] if isinstance(active, str) else list(active)


def trainable_adapters(peft_model: peft.PeftModel) -> list[str]:
    """Adapters with at least one tensor that receives gradients, in creation order."""
    names: set[str] = set()
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            for attr in module.adapter_layer_names:
                for name, sub in getattr(module, attr).items():
                    params = sub.parameters() if isinstance(sub, nn.Module) else [sub]
                    if any(p.requires_grad for p in params):
                        names.add(name)
    return [name for name in adapter_names(peft_model) if name in names]


def get_adapter_state(peft_model: peft.PeftModel, name: str) -> dict[str, Tensor]:
    """The tensors of one adapter, as detached CPU copies.

    Keys are peft's saved keys, which omit the adapter name
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so the state loads into
    any adapter of the same shape.

    Raises:
        UnknownNameError: ``name`` is not an adapter of the model.
    """
    _check_adapter(peft_model, name)
    state = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}


def set_adapter_state(peft_model: peft.PeftModel, name: str, state: dict[str, Tensor]) -> None:
    """Writes ``state`` (from :func:`get_adapter_state` of any adapter) into adapter ``name``.

    Values are copied into the existing parameters, so optimizers holding them stay valid.

    Raises:
        UnknownNameError: ``name`` is not an adapter of the model.
        AdapterStateError: Keys are missing or unknown, or a shape differs.
    """
    _check_adapter(peft_model, name)
    expected = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    _check_state(f"adapter '{name}'", expected, state)
    result: Any = set_peft_model_state_dict(peft_model, state, adapter_name=name)
    if result.unexpected_keys:  # cannot happen after the check unless peft renames keys
        raise AdapterStateError(
            f"adapter '{name}': peft did not place {result.unexpected_keys[:3]}"
        )


def adapter_tensors(peft_model: peft.PeftModel, name: str) -> dict[str, nn.Parameter]:
    """The live parameters of one adapter (not copies), under peft's saved keys.

    The keys are :func:`get_adapter_state`'s, worked out by peft itself
    (``get_peft_model_state_dict`` over the model's own parameters), so a module that holds a
    peft model sends its adapter in the one format without copying peft's renaming rules.

    Raises:
        UnknownNameError: ``name`` is not an adapter of the model.
    """
    _check_adapter(peft_model, name)
    live = dict(peft_model.named_parameters())
    return get_peft_model_state_dict(
        peft_model, state_dict=live, adapter_name=name, save_embedding_layers=False
    )


def adapter_param_names(peft_model: peft.PeftModel, name: str) -> dict[str, str]:
    """Saved key -> the model's parameter name (which names the adapter) of one adapter.

    What finds the parameter of a tensor that travels under its saved key (FedProx's reference
    and SCAFFOLD's correction are keyed like the messages, training loops by parameter name).

    Raises:
        UnknownNameError: ``name`` is not an adapter of the model.
    """
    names = {id(p): n for n, p in peft_model.named_parameters()}
    return {key: names[id(p)] for key, p in adapter_tensors(peft_model, name).items()}


def trainable_state(peft_model: peft.PeftModel) -> dict[str, Tensor]:
    """The adapters that are trainable now, as one flat dict grouped by adapter name.

    Keys are ``"<adapter>/<saved key>"`` (``local/base_model.model...q_proj.lora_A.weight``), so
    several trainable adapters never collide and each group loads into any adapter of the same
    shape (``get_group(state, "local")``). Values are detached CPU copies; base-model tensors
    are never included.
    """
    return join_groups(
        {name: get_adapter_state(peft_model, name) for name in trainable_adapters(peft_model)}
    )


# The key of a LoRA tensor that still names its adapter: the model's parameter name
# (``...lora_A.default.weight``, ``...lora_magnitude_vector.default.weight``), which fedfm
# sent and checkpointed before adapters travelled under peft's saved keys.
_NAMED_ADAPTER_KEY = re.compile(
    r"(?:^|[./])lora_(?:A|B|magnitude_vector)\.(?!weight$|bias$)[^./]+\.(?:weight|bias)$"
)


def named_adapter_keys(keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` that name their LoRA adapter (fedfm's earlier format).

    Keys in the one format (peft's saved keys, ``"<group>/<saved key>"``) are never listed.
    """
    return [key for key in keys if _NAMED_ADAPTER_KEY.search(key)]


def save_adapter(peft_model: peft.PeftModel, name: str, folder: str | Path) -> Path:
    """Saves one adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``).

    The files go directly into ``folder`` (peft itself nests non-default adapters in a
    sub-folder), so plain peft loads them with ``PeftModel.from_pretrained(base, folder)``.

    Returns:
        ``folder`` as a ``Path``.
    """
    _check_adapter(peft_model, name)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".save-") as tmp:
        peft_model.save_pretrained(tmp, selected_adapters=[name])
        written = Path(tmp) / name if name != "default" else Path(tmp)
        for item in written.iterdir():
            if item.is_file():
                shutil.move(str(item), folder / item.name)
    return folder


def load_adapter(peft_model: peft.PeftModel, name: str, folder: str | Path) -> None:
    """Loads an adapter saved by :func:`save_adapter` (or by plain peft) as adapter ``name``.

    A new ``name`` is added from the folder's config, inactive and frozen; an existing one gets
    the saved weights (strictly checked) and keeps its activity and trainability. Call
    :func:`set_active` to change them.

    Raises:
        AssetMissingError: ``folder`` holds no peft adapter.
        AdapterStateError: The saved weights do not fit an existing adapter ``name``.
    """
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise AssetMissingError(f"no peft adapter (adapter_config.json) in {folder}")
    if name in peft_model.peft_config:
        set_adapter_state(peft_model, name, load_peft_weights(str(folder), device="cpu"))
        return
    if "." in name:
        raise ConfigError("lora.adapters", f"adapter name {name!r} must not contain dots")
    training = peft_model.training  # peft's load_adapter switches the model to eval mode
    peft_model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
    peft_model.train(training)
    tuner: Any = peft_model.base_model
    tuner.set_requires_grad([name], requires_grad=False)


def _check_adapter(peft_model: peft.PeftModel, name: str) -> None:
    if not isinstance(peft_model, peft.PeftModel):
        raise ConfigError("lora", f"expected a peft.PeftModel, got {type(peft_model).__name__}")
    if name not in peft_model.peft_config:
        have = ", ".join(peft_model.peft_config) or "none"
        raise UnknownNameError("lora.adapter", f"unknown adapter '{name}' (have {have})")


def _check_state(what: str, expected: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise AdapterStateError(
            f"{what}: {len(missing)} missing keys {missing[:2]}, {len(unknown)} unknown keys "
            f"{unknown[:2]}"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise AdapterStateError(
                f"{what}: {key} has shape {tuple(value.shape)}, expected "
                f"{tuple(expected[key].shape)}"
            )


def _adapter_param_ids(peft_model: nn.Module) -> set[int]:
    """Ids of every parameter that belongs to an adapter (LoRA A/B, embeddings, magnitudes)."""
    ids: set[int] = set()
    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer):
            for attr in module.adapter_layer_names:
                ids.update(id(p) for p in getattr(module, attr).parameters())
    return ids
