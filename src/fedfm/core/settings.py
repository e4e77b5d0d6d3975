"""The config sections the core owns: local training and client-level DP.

:class:`TrainConfig` is read by :mod:`fedfm.core.train` and :mod:`fedfm.core.dp`,
:class:`UserLevelConfig` by :mod:`fedfm.core.userdp`; :class:`fedfm.config.RunConfig` composes
them (and re-exports them, where configs are usually imported from). This module imports
pydantic and :mod:`fedfm.errors` only, so loading a config loads no torch.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedfm.errors import ConfigError


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
"""bitsandbytes' AdamW variants: 8-bit optimizer state (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", ICLR 2022) and paged state that spills to CPU memory under pressure
(QLoRA's paged optimizers). They need CUDA and ``pip install 'fedfm[quant]'``."""


class LrSchedule(Strict):
    """The clients' local learning rate over rounds; ``train.lr`` is its maximum.

    ``cosine`` anneals from ``train.lr`` to ``min_lr`` as FlowerTune's ``cosine_annealing``
    does: round ``t`` of ``T`` trains at ``min_lr + (lr - min_lr)(1 + cos(pi t / T)) / 2``.
    ``warmup_rounds`` ``W > 0`` first rises linearly (round ``t <= W`` at ``lr t / W``), and the
    schedule then runs over the remaining ``T - W`` rounds. The rate is a function of the
    round alone, so a resumed run trains exactly as an uninterrupted one.

    Attributes:
        name: ``constant`` or ``cosine``.
        min_lr: The rate ``cosine`` ends at (at most ``train.lr``).
        warmup_rounds: Rounds of linear warm-up (fewer than the run's rounds).
    """

    name: Literal["constant", "cosine"] = "constant"
    min_lr: float = Field(0.0, ge=0)
    warmup_rounds: int = Field(0, ge=0)

    def is_constant(self) -> bool:
        """Whether every round trains at ``train.lr``."""
        return self.name == "constant" and not self.warmup_rounds


class TrainConfig(Strict):
    """Local training shared by every algorithm (see :func:`fedfm.core.train.local_train`).

    Exactly one of ``steps`` and ``epochs`` is used: ``epochs`` wins when set. ``optimizer``
    also takes bitsandbytes' 8-bit and paged AdamW (:data:`BNB_OPTIMIZERS`).
    """

    steps: int = Field(10, ge=1)
    epochs: float | None = Field(None, gt=0)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal[
        "sgd", "adam", "adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"
    ] = "sgd"
    lr: float = Field(0.05, gt=0)
    schedule: LrSchedule = Field(default_factory=LrSchedule)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    clip_norm: float | None = Field(None, gt=0)
    prox_mu: float = Field(0.0, ge=0)

    @field_validator("optimizer")
    @classmethod
    def _bnb_installed(cls, v: str) -> str:
        if v in BNB_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"{v} needs the bitsandbytes package: pip install 'fedfm[quant]'")
        return v

    @model_validator(mode="after")
    def _min_below_max(self) -> TrainConfig:
        if self.schedule.min_lr > self.lr:
            raise ConfigError(
                "train.schedule.min_lr",
                f"{self.schedule.min_lr:g} is above train.lr ({self.lr:g}), the schedule's maximum",
            )
        return self


class AdaptiveClipConfig(Strict):
    """Adaptive clipping of DP-FedAvg by a noised quantile (Andrew et al., NeurIPS 2021).

    Attributes:
        target_quantile: γ, the share of client updates that should fall below the bound.
        lr: η_C of the geometric update ``C ← C·exp(−η_C·(b̃ − γ))``.
        count_stddev: σ_b, the noise std of the count of updates below the bound; None takes
            Andrew et al.'s recommendation, the expected clients per round / 20.
    """

    target_quantile: float = Field(0.5, ge=0, le=1)
    lr: float = Field(0.2, gt=0)
    count_stddev: float | None = Field(None, gt=0)


class UserLevelConfig(Strict):
    """Client-level DP-FedAvg (McMahan et al., ICLR 2018; see :mod:`fedfm.core.userdp`).

    Attributes:
        clip: C, the bound on each client's update norm (the first bound when adaptive).
        noise_multiplier: z: the noise on the sum of clipped updates has std ``z·C``; 0 clips
            without noise (ε = ∞). None: calibrated from ``epsilon``.
        epsilon: The client-level ε to reach after ``rounds`` rounds at ``privacy.delta``.
        mode: ``server``: the server clips each update and adds the noise (it is trusted and
            sees every raw update); ``client``: each client clips its own update and adds
            its share ``z·C/√min_clients`` of the noise, so nothing unnoised leaves it.
        min_clients: Client mode: the fewest replies a round needs for its shares to add up
            to the full noise; a round with fewer leaves the model as it was.
        adaptive: Adaptive clipping by a noised quantile; None: the bound stays ``clip``.
    """

    clip: float = Field(gt=0)
    noise_multiplier: float | None = Field(None, ge=0)
    epsilon: float | None = Field(None, gt=0)
    mode: Literal["server", "client"] = "client"
    min_clients: int | None = Field(None, ge=1)
    adaptive: AdaptiveClipConfig | None = None


class SecAggConfig(Strict):
    """SecAgg+ (Bell et al., CCS 2020; see :mod:`fedfm.core.secagg`).

    Defaults as Flower's ``SecAggPlusWorkflow`` where it has them (``max_weight``,
    ``clipping_range``, ``quantization_range``, ``modulus_range``); ``num_shares`` and
    ``reconstruction_threshold``, which Flower asks for, default to every sampled client and
    60% of the shares (ours).

    Attributes:
        num_shares: Shares of each client's secrets, its own included: an integer above 2,
            or a fraction (at most 1) of the round's clients.
        reconstruction_threshold: Shares that rebuild a secret: an integer, or a fraction of
            ``num_shares``; at least half of the shares and at most all of them.
        max_weight: A client's example count is carried in its masked vector as
            ``min(1, n_k/max_weight)`` (larger counts weigh as ``max_weight``).
        clipping_range: Each coordinate of a weighted update is clipped to ``±clipping_range``
            before quantisation.
        quantization_range: Levels of the quantisation, ``[0, quantization_range − 1]``.
        modulus_range: The modulus of the masked sum, a power of two up to 2**62 above the
            round's clients times ``quantization_range``.
        dp_noise: Client-side DP-FedAvg's noise under SecAgg+: ``discrete_gaussian`` (the
            distributed discrete Gaussian, :mod:`fedfm.core.ddg`, whose ε covers what is
            sent) or ``continuous`` (each client's Gaussian share, then clipped to
            ``clipping_range`` and rounded: ε is the continuous sum's, which does not
            strictly cover the rounding).
        gamma: The discrete Gaussian's grid step; None: the smallest the modulus allows.
        beta: The discrete Gaussian's conditional rounding parameter (the paper's e^(-1/2)).
    """

    num_shares: int | float = Field(1.0, gt=0)
    reconstruction_threshold: int | float = Field(0.6, gt=0)
    max_weight: float = Field(1000.0, gt=0)
    clipping_range: float = Field(8.0, gt=0)
    quantization_range: int = Field(4194304, ge=2)
    modulus_range: int = Field(4294967296, ge=4)
    dp_noise: Literal["discrete_gaussian", "continuous"] = "discrete_gaussian"
    gamma: float | None = Field(None, gt=0)
    beta: float = Field(0.6065306597126334, gt=0, lt=1)

    @field_validator("num_shares")
    @classmethod
    def _shares(cls, v: int | float) -> int | float:
        if isinstance(v, float) and v > 1:
            raise ValueError("a fraction of the round's clients must be at most 1")
        if isinstance(v, int) and v <= 2:
            raise ValueError("as an integer it must be above 2")
        return v

    @field_validator("reconstruction_threshold")
    @classmethod
    def _threshold(cls, v: int | float) -> int | float:
        if isinstance(v, float) and v > 1:
            raise ValueError("a fraction of the shares must be at most 1")
        return v

    @field_validator("modulus_range")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1) or v > 2**62:
            raise ValueError(f"{v} must be a power of two up to 2**62")
        return v


class _ClientsView(Protocol):
    @property
    def fraction(self) -> float: ...


class _PrivacyView(Protocol):
    @property
    def delta(self) -> float: ...

    @property
    def accountant(self) -> Literal["rdp", "pld"]: ...

    @property
    def noise(self) -> Literal["secret", "seeded"]: ...

    @property
    def secure_aggregation(self) -> Literal["none", "secagg+"]: ...

    @property
    def secagg(self) -> SecAggConfig: ...


class RunView(Protocol):
    """What the core reads of a run's config (:class:`fedfm.config.RunConfig` provides it).

    The core never imports the run config; it names the few values it needs here.
    """

    @property
    def seed(self) -> int:
        """The run seed every derived seed starts from."""
        ...

    @property
    def rounds(self) -> int:
        """Planned rounds (learning-rate schedules, privacy planning)."""
        ...

    @property
    def clients(self) -> _ClientsView:
        """Client sampling (``fraction``: the sampling rate of DP accounting)."""
        ...

    @property
    def privacy(self) -> _PrivacyView:
        """The run's ``delta``, accountant and noise source."""
        ...


#: The wire codecs of :mod:`fedfm.core.codec` (its registry checks this list), named here
#: so that a config loads without importing torch.
CODEC_NAMES = ("float32", "bfloat16", "float16", "int8", "nf4")


class CommConfig(Strict):
    """``comm``: the codecs array fields travel in (:mod:`fedfm.core.codec`).

    Attributes:
        uplink: Codec of client-to-server array fields; None: tensors as they are.
        downlink: Codec of server-to-client array fields; None: tensors as they are.
        fields: ``"<kind>.<field>"`` array fields the codecs apply to (e.g.
            ``train.params``); None: every array field.
    """

    uplink: str | None = Field(None, description="float32 | bfloat16 | float16 | int8 | nf4")
    downlink: str | None = Field(None, description="float32 | bfloat16 | float16 | int8 | nf4")
    fields: list[str] | None = Field(None, description="'<kind>.<field>' fields to code; all")

    @field_validator("uplink", "downlink")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in CODEC_NAMES:
            raise ValueError(f"unknown codec '{v}' (choose from {', '.join(CODEC_NAMES)})")
        return v

    @field_validator("fields")
    @classmethod
    def _dotted(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name.count(".") < 1:
                raise ValueError(f"'{name}' is not '<kind>.<field>'")
        return v
