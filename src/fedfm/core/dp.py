"""DP-SGD on the trainable adapters of the shared model, with Opacus.

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016) as Opacus 1.6
implements it (Yousefpour et al., "Opacus: User-Friendly Differential Privacy Library in
PyTorch", 2021). One step:

1. **Poisson sampling**: each encoded row joins the batch independently with probability
   ``q = batch_size / n`` (the sampling the accountant assumes; batches vary in size).
2. **Per-sample gradients** of the trainable tensors only (the LoRA adapters; the base is
   frozen) from Opacus's ``GradSampleModule`` in hooks mode, which works on a peft model.
3. **Clip and noise** (Opacus's ``DPOptimizer``): each sample's gradient is clipped to L2 norm
   ``C = max_grad_norm``, the clipped gradients are summed, ``N(0, (σ·C)²)`` noise is added
   and the sum is divided by the *expected* batch size ``q·n``; then the optimizer steps.

**Per-sample loss.** Hugging Face's ``out.loss`` is the token mean over the whole batch, which
mixes samples. Here each sample's loss is its own mean over its response tokens
(``loss: token_mean``, the default) or their sum (``token_sum``); the batch loss is the mean of
the per-sample losses (Opacus ``loss_reduction="mean"`` turns its gradients back into
per-sample ones).

**Noise calibration.** ``σ`` is the smallest noise multiplier (to Opacus's tolerance of 0.01 in
ε) whose RDP guarantee after ``planned_steps`` steps at rate ``q`` is at most
``(epsilon, delta)``: Opacus's ``get_noise_multiplier`` with its RDP accountant, the accountant
the privacy ledger (:mod:`fedfm.core.privacy`) uses by default. A client calibrates once, on
its first DP call, and keeps ``σ``. ``epsilon: .inf`` trains without clipping or noise (same
sampling and loss): the non-private reference point.

**Accounting.** A client's history of ``(σ, q, steps)`` lives in its persistent state
(``state.meta[key]``), so it survives rounds and resume; each call returns the ε spent so far
(Opacus's RDP accountant) and a report of ``(σ, q, steps, C)`` for the run's privacy ledger.

**Shared model.** The model is the process-wide PeftModel that every simulated client uses; the
hooks and every attribute Opacus adds (``grad_sample``, ``_forward_counter``, ``summed_grad``,
``activations``, ...) are removed when a call ends, even when it fails.

Choices of ours: a Poisson batch larger than ``physical_batch_size`` runs as several forward and
backward passes whose clipped per-sample gradients add up before the one noisy step (Opacus's
virtual steps); an empty Poisson batch still takes a noise-only step, as with Opacus's own
Poisson data loader; ``planned_steps`` is every round's local steps, as if the client took part
in every round (an upper bound on what it spends); Poisson batches and noise come from
``torch.Generator`` s seeded from the caller's ``seed``, which a client draws from its own
secret (:func:`fedfm.core.secret.noise_seed`; from the run seed only under
``privacy.noise: seeded``). That generator is not a cryptographically secure source (Opacus's
``secure_mode`` needs ``torchcsprng``). The noise is drawn on the CPU and moved to each
gradient's device (:class:`CPUNoiseDPOptimizer`), so a seeded run adds the same noise on any
device; per-sample gradients, clipping and the step run where the model is.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch import Tensor, nn

from fedfm.core.batching import IGNORE_INDEX, collate
from fedfm.core.seeding import derive_seed
from fedfm.core.settings import TrainConfig
from fedfm.core.state import ClientState
from fedfm.core.train import make_optimizer, trainable
from fedfm.errors import ConfigError, FedfmError

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]
Rows = Sequence[Mapping[str, Sequence[int]]]

# What Opacus sets on parameters and modules; removed after every call (see the module doc).
_PARAM_ATTRS: tuple[str, ...] = (
    "grad_sample",
    "_forward_counter",
    "_current_grad_sample",
    "_norm_sample",
)
_PARAM_ATTRS += ("summed_grad", "_processed")
_MODULE_ATTRS = ("activations", "max_batch_len", "ft_compute_sample_grad")


class DPSGDConfig(pydantic.BaseModel):
    """DP-SGD settings (a config section algorithms embed, e.g. ``algo.dp``).

    Attributes:
        epsilon: Target ε after the planned steps; ``.inf`` trains without clipping or noise.
        delta: Target δ; ``None`` takes the run's ``privacy.delta``. Must be below ``1/n`` for
            every client's ``n`` rows.
        max_grad_norm: Clipping norm ``C`` of each sample's gradient.
        noise_multiplier: ``σ`` to use as given instead of calibrating it from ``epsilon``.
        loss: Per-sample loss: mean (``token_mean``) or sum (``token_sum``) over its response
            tokens.
        physical_batch_size: Rows per forward/backward pass within one Poisson batch.
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    epsilon: float = pydantic.Field(8.0, gt=0)
    delta: float | None = pydantic.Field(None, gt=0, lt=1)
    max_grad_norm: float = pydantic.Field(1.0, gt=0)
    noise_multiplier: float | None = pydantic.Field(None, ge=0)
    loss: Literal["token_mean", "token_sum"] = "token_mean"
    physical_batch_size: int = pydantic.Field(8, ge=1)

    @property
    def private(self) -> bool:
        """Whether training clips and adds noise (``False`` for ``epsilon = inf``)."""
        return self.noise_multiplier is not None or math.isfinite(self.epsilon)


def sample_rate(batch_size: int, n: int) -> float:
    """Poisson sampling rate ``min(1, batch_size / n)``."""
    if n < 1:
        raise FedfmError("DP-SGD needs at least one training row")
    return min(1.0, batch_size / n)


def check_delta(delta: float, n: int, field: str = "privacy.delta") -> None:
    """Refuses ``delta >= 1/n``: such a δ allows releasing a whole record outright.

    Raises:
        ConfigError: Naming ``field``.
    """
    if delta >= 1.0 / n:
        raise ConfigError(field, f"delta={delta:g} must be below 1/n = {1.0 / n:.3g} ({n} rows)")


def calibrate_noise(
    epsilon: float, delta: float, rate: float, steps: int, field: str = "algo.dp"
) -> float:
    """The DP-SGD noise multiplier reaching ``(epsilon, delta)`` after ``steps`` at ``rate``.

    Opacus's ``get_noise_multiplier`` on its RDP accountant (tolerance 0.01 in ε, the result
    errs on the private side); ``epsilon = inf`` gives 0.

    Raises:
        ConfigError: The target cannot be reached (field ``<field>.epsilon``): with the RDP
            accountant's orders no noise below Opacus's cap of 1e6 gives this ε at this δ.
    """
    if not math.isfinite(epsilon):
        return 0.0
    if steps < 1:
        raise ConfigError(f"{field}.steps", f"planned steps must be >= 1, got {steps}")
    try:
        return _noise_multiplier(epsilon, delta, rate, steps)
    except ValueError:
        raise ConfigError(
            f"{field}.epsilon",
            f"epsilon={epsilon:g} at delta={delta:g} cannot be reached in {steps} steps at "
            f"sampling rate {rate:.3g} (the RDP accountant needs a noise multiplier above 1e6)",
        ) from None


@functools.lru_cache(maxsize=64)
def _noise_multiplier(epsilon: float, delta: float, rate: float, steps: int) -> float:
    """Opacus's noise search, once per process and target.

    It takes seconds at fractional rates, and every client of a rate needs the same answer.
    """
    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=rate,
            steps=steps,
            accountant="rdp",
        )
    )


def plan_dp_sgd(
    dp: DPSGDConfig,
    delta: float,
    sizes: Mapping[str, int],
    batch_size: int,
    planned_steps: int,
    field: str = "algo.dp",
    *,
    delta_field: str | None = None,
    epsilon_field: str | None = None,
) -> dict[str, float]:
    """Checks a DP-SGD plan for every client before the run starts (call it at config load).

    Args:
        dp: DP-SGD settings.
        delta: The δ in use (``dp.delta`` or the run's ``privacy.delta``).
        sizes: Client id -> number of encoded training rows.
        batch_size: Expected Poisson batch size.
        planned_steps: Steps a client may take in the whole run.
        field: Config field named in errors.
        delta_field: The field of δ, if not ``<field>.delta`` (e.g. ``privacy.delta``).
        epsilon_field: The field of ε, if not ``<field>.epsilon``.

    Returns:
        Client id -> the noise multiplier its first :func:`dp_train` call will choose.

    Raises:
        ConfigError: A client's ``delta >= 1/n`` (``<field>.delta``) or an unreachable ε
            (``<field>.epsilon``), naming the client.
    """
    sigmas: dict[str, float] = {}
    by_rate: dict[float, float] = {}
    for cid, n in sizes.items():
        try:
            check_delta(delta, n, delta_field or f"{field}.delta")
            rate = sample_rate(batch_size, n)
            if dp.noise_multiplier is not None:
                sigmas[cid] = dp.noise_multiplier
                continue
            if rate not in by_rate:
                by_rate[rate] = calibrate_noise(dp.epsilon, delta, rate, planned_steps, field)
            sigmas[cid] = by_rate[rate]
        except ConfigError as err:
            name = err.field
            if epsilon_field is not None and name == f"{field}.epsilon":
                name = epsilon_field
            raise ConfigError(name, f"client {cid}: {err.reason}") from None
    return sigmas


@dataclass
class DPAccount:
    """One client's DP-SGD accounting, kept in its persistent state.

    Attributes:
        noise_multiplier: ``σ`` chosen at the client's first DP call.
        history: ``(σ, q, steps)`` runs, merged when ``σ`` and ``q`` repeat (Opacus's format).
    """

    noise_multiplier: float
    history: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """DP-SGD steps taken so far."""
        return sum(k for _, _, k in self.history)

    def add(self, sigma: float, rate: float, steps: int) -> None:
        """Records ``steps`` more steps at ``(sigma, rate)``."""
        if steps <= 0:
            return
        if self.history and self.history[-1][:2] == (sigma, rate):
            self.history[-1] = (sigma, rate, self.history[-1][2] + steps)
        else:
            self.history.append((sigma, rate, steps))

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (Opacus's RDP accountant); ``inf`` without noise."""
        if not self.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self.history):
            return math.inf
        accountant = RDPAccountant()
        accountant.history = list(self.history)
        return float(accountant.get_epsilon(delta=delta))

    def to_meta(self) -> dict[str, Any]:
        """A JSON-able form for ``ClientState.meta``."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "history": [list(h) for h in self.history],
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> DPAccount:
        """The inverse of :meth:`to_meta`."""
        history = [(float(s), float(q), int(k)) for s, q, k in meta["history"]]
        return cls(float(meta["noise_multiplier"]), history)


@dataclass
class DPResult:
    """What one DP-SGD call did.

    Attributes:
        steps: Optimizer steps taken.
        loss: Mean over steps of the batch loss (mean of per-sample losses).
        noise_multiplier: ``σ`` (0 without noise).
        sample_rate: Poisson rate ``q``.
        max_grad_norm: Clipping norm ``C`` (not applied when ``noise_multiplier`` is 0).
        epsilon: ε spent by this client so far, at ``delta``.
        delta: The δ of ``epsilon``.
    """

    steps: int
    loss: float
    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    epsilon: float
    delta: float

    def report(self) -> dict[str, float]:
        """This call's mechanism for the privacy ledger (a reply's meta field).

        :meth:`fedfm.core.privacy.PrivacyLedger.add_dp_sgd_report` reads it.
        """
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": float(self.steps),
            "max_grad_norm": self.max_grad_norm,
        }


def per_sample_loss(
    model: nn.Module, batch: Mapping[str, Tensor], reduction: str = "token_mean"
) -> Tensor:
    """Cross-entropy of each sample over its response tokens (labels ``-100`` elsewhere).

    Returns:
        ``(B,)`` float32: each row's mean (``token_mean``) or sum (``token_sum``) of token
        losses; a row without response tokens has loss 0.
    """
    device = next(model.parameters()).device
    logits = model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
    ).logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
    labels = batch["labels"][:, 1:].to(device)  # (B, T-1)
    tokens = nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)  # (B, T-1), 0 where ignored
    total = tokens.sum(1)
    if reduction == "token_sum":
        return total
    return total / (labels != IGNORE_INDEX).sum(1).clamp_min(1)


def poisson_batches(n: int, rate: float, steps: int, seed: int) -> Iterator[list[int]]:
    """Row indices of ``steps`` Poisson batches: each row in each batch with prob. ``rate``."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "dp-poisson"))
    for _ in range(steps):
        yield torch.nonzero(torch.rand(n, generator=gen) < rate).flatten().tolist()


@contextlib.contextmanager
def grad_sample_hooks(model: nn.Module) -> Iterator[GradSampleModule]:
    """``model`` wrapped by Opacus for per-sample gradients, left clean on exit."""
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    try:
        yield gsm
    finally:
        gsm.cleanup()
        release(model)


def release(model: nn.Module) -> None:
    """Removes every attribute Opacus may have left on ``model``'s parameters and modules."""
    for param in model.parameters():
        for attr in _PARAM_ATTRS:
            param.__dict__.pop(attr, None)
    for module in model.modules():
        for attr in _MODULE_ATTRS:
            module.__dict__.pop(attr, None)
    if "autograd_grad_sample_hooks" in model.__dict__:
        for handle in model.__dict__.pop("autograd_grad_sample_hooks"):
            handle.remove()


class CPUNoiseDPOptimizer(DPOptimizer):
    """Opacus's ``DPOptimizer`` whose Gaussian noise is drawn from a CPU generator.

    Opacus draws the noise on the device of each gradient with a generator of that device, so
    the same seed gives other numbers on a GPU than on the CPU. Here the draw is the one
    Opacus makes on the CPU (same calls, same order), then moved to the gradient's device.
    """

    def add_noise(self) -> None:
        """Adds ``N(0, (σ·C)²)`` noise, drawn on the CPU, to each clipped gradient sum."""
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            summed = p.summed_grad
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=torch.empty(summed.shape, dtype=summed.dtype),  # CPU: shape, dtype
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            p.grad = (summed + noise.to(summed.device)).view_as(p)
            _mark_as_processed(p.summed_grad)


def dp_step(
    gsm: nn.Module,
    optimizer: DPOptimizer,
    rows: Rows,
    pad_id: int,
    cfg: DPSGDConfig,
    autocast: AutocastFactory = contextlib.nullcontext,
) -> float:
    """One DP-SGD step on one Poisson batch (possibly empty): clip, sum, noise, step.

    Returns:
        The batch loss (mean of per-sample losses; 0 for an empty batch).
    """
    optimizer.zero_grad(set_to_none=True)
    if not rows:  # a noise-only step
        for p in optimizer.params:
            p.grad_sample = p.new_zeros((0, *p.shape))
        optimizer.step()
        return 0.0
    chunks = [
        rows[i : i + cfg.physical_batch_size] for i in range(0, len(rows), cfg.physical_batch_size)
    ]
    total = 0.0
    for k, chunk in enumerate(chunks):
        with autocast():
            losses = per_sample_loss(gsm, collate(chunk, pad_id), cfg.loss)  # (b,)
        with warnings.catch_warnings():
            # Opacus's full backward hooks note that no module input requires grad (frozen base).
            warnings.simplefilter("ignore", UserWarning)
            losses.mean().backward()
        total += float(losses.detach().sum())
        if k < len(chunks) - 1:  # accumulate this chunk's clipped gradients, no step yet
            optimizer.signal_skip_step(do_skip=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    return total / len(rows)


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Rows,
    pad_id: int,
    cfg: DPSGDConfig,
    autocast: AutocastFactory = contextlib.nullcontext,
) -> float:
    """The ``epsilon = inf`` step: same batch and loss, no clipping, no noise."""
    optimizer.zero_grad(set_to_none=True)
    if not rows:
        return 0.0
    with autocast():
        loss = per_sample_loss(model, collate(rows, pad_id), cfg.loss).mean()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def dp_train(
    model: nn.Module,
    rows: Rows,
    state: ClientState,
    *,
    train: TrainConfig,
    dp: DPSGDConfig,
    delta: float,
    steps: int,
    planned_steps: int,
    seed: int,
    pad_id: int,
    autocast: AutocastFactory = contextlib.nullcontext,
    key: str = "dp",
    field: str = "algo.dp",
) -> DPResult:
    """Trains the trainable tensors of ``model`` with DP-SGD for ``steps`` steps.

    Args:
        model: The model; only parameters with ``requires_grad`` (the trainable adapters)
            are trained and privatised.
        rows: Encoded rows (``input_ids``, ``attention_mask``, ``labels``) of this client.
        state: The client's persistent state; its account is kept under ``state.meta[key]``.
        train: Optimizer, learning rate and expected batch size (``train.batch_size``);
            ``train.clip_norm`` is replaced by ``dp.max_grad_norm``.
        dp: DP-SGD settings.
        delta: The δ to calibrate and report at (``dp.delta`` or the run's).
        steps: Steps of this call.
        planned_steps: Steps the client may take in the whole run (calibration).
        seed: Seeds Poisson sampling and noise (``noise_seed(ctx, "dp", mode)``: the client's
            secret, or ``ctx.rng_seed("dp")`` when seeded).
        pad_id: Padding token id.
        autocast: Context of each forward pass.
        key: Where the account lives in ``state.meta`` (one per privatised model).
        field: Config field named in errors (``<field>.epsilon``, ``<field>.delta``).

    Returns:
        The steps, loss, ``σ``, ``q`` and ε spent so far.

    Raises:
        ConfigError: ``delta >= 1/n`` or an unreachable ε, naming the field.
    """
    n = len(rows)
    rate = sample_rate(train.batch_size, n)
    check_delta(delta, n, f"{field}.delta")
    if key in state.meta:
        account = DPAccount.from_meta(state.meta[key])
    elif dp.noise_multiplier is not None:
        account = DPAccount(dp.noise_multiplier)
    else:
        account = DPAccount(calibrate_noise(dp.epsilon, delta, rate, planned_steps, field))
    sigma = account.noise_multiplier if dp.private else 0.0
    params = list(trainable(model).values())
    if not params:
        raise FedfmError("DP-SGD: the model has no trainable tensors (choose a trainable adapter)")
    optimizer = make_optimizer(params, train)
    was_training = model.training
    model.train()
    losses = []
    try:
        batches = poisson_batches(n, rate, steps, seed)
        if dp.private:
            noise = torch.Generator()  # on the CPU: see CPUNoiseDPOptimizer
            noise.manual_seed(derive_seed(seed, "dp-noise"))
            with grad_sample_hooks(model) as gsm:
                private = CPUNoiseDPOptimizer(
                    optimizer,
                    noise_multiplier=sigma,
                    max_grad_norm=dp.max_grad_norm,
                    expected_batch_size=max(1, round(rate * n)),
                    loss_reduction="mean",
                    generator=noise,
                )
                for idx in batches:
                    rows_k = [rows[i] for i in idx]
                    losses.append(dp_step(gsm, private, rows_k, pad_id, dp, autocast))
                private.zero_grad(set_to_none=True)
        else:
            for idx in batches:
                rows_k = [rows[i] for i in idx]
                losses.append(plain_step(model, optimizer, rows_k, pad_id, dp, autocast))
            optimizer.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)
    account.add(sigma, rate, steps)
    state.meta[key] = account.to_meta()
    return DPResult(
        steps=steps,
        loss=sum(losses) / max(len(losses), 1),
        noise_multiplier=sigma,
        sample_rate=rate,
        max_grad_norm=dp.max_grad_norm,
        epsilon=account.epsilon(delta),
        delta=delta,
    )
