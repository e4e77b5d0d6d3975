"""Aggregation of client updates: example-weighted means over named tensors, as they arrive.

Federated averaging needs only running sums: Σ_k w_k·u_k and Σ_k w_k. The accumulators here
take one update at a time (:meth:`RunningMean.add`), so a server that folds each reply in as
it comes holds one reply and one accumulator rather than every reply; 100 clients then cost
about what one does. The batch functions :func:`weighted_mean` and :func:`pseudo_gradient`
are the same accumulators fed a list, so both paths give the same numbers bit for bit.

Aggregators that need every update at once (coordinate-wise median, Krum) cannot stream;
:class:`Buffered` keeps the updates and hands them to such a function at the end, behind the
same ``add``/``result`` interface (:class:`Aggregator`).

One round's aggregation step, the same for every algorithm whose server step is a sum of
client updates, is :func:`aggregate_round`: stream the update replies into a
:class:`RoundSum`, require enough of them, close the sum. The plain (or robust) mean is a
:class:`ReplySum`; client-level DP-FedAvg's clipped, noised sum
(:class:`fedfm.core.userdp.DPSum`) and a SecAgg+ sum of masked vectors
(:class:`fedfm.core.secagg.SecAgg`, a :class:`SecureSummer`) meet it there, and nowhere else.

Arithmetic: sums run in float32 for float32, float16 and bfloat16 tensors and in float64 for
float64 ones (and for integer tensors of :func:`weighted_mean`); the sum is divided by the
total weight at the end. Inputs are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from fedfm.core.federation import Federation, Templates
from fedfm.core.messages import Message
from fedfm.core.replies import meta_number
from fedfm.errors import TooFewClientsError

Arrays = dict[str, Tensor]
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# ----------------------------------------------------------------------------- checks


def _names(keys: Sequence[str] | set[str], limit: int = 5) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


def check_keys(expected: Mapping[str, Tensor], got: Mapping[str, Tensor], what: str) -> None:
    """Refuses ``got`` unless it has exactly the keys of ``expected``.

    Raises:
        ValueError: Missing or unexpected names, a few of each named.
    """
    missing = set(expected) - set(got)
    extra = set(got) - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"unexpected {_names(extra)}")
        raise ValueError(f"{what}: tensor names do not match ({'; '.join(parts)})")


def check_shape(ref: Tensor, t: Tensor, what: str) -> None:
    """Refuses ``t`` unless it is a tensor of ``ref``'s shape.

    Raises:
        ValueError: Not a tensor, or another shape.
    """
    if not isinstance(t, Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.shape != ref.shape:
        raise ValueError(f"{what}: shape {tuple(t.shape)} does not match {tuple(ref.shape)}")


def check_weight(w: float, index: int, what: str) -> float:
    """Returns ``w`` as a float after refusing a negative or non-finite weight.

    Raises:
        ValueError: The weight is negative, NaN or infinite.
    """
    w = float(w)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"{what}: weight {index} is {w}; weights must be finite and >= 0")
    return w


def check_weights(weights: Sequence[float], count: int, what: str) -> list[float]:
    """Returns the weights as floats after refusing bad ones (one per update, total > 0).

    Raises:
        ValueError: Wrong count, a bad weight, or a total that is not positive.
    """
    if len(weights) != count:
        raise ValueError(f"{what}: {len(weights)} weights for {count} updates")
    ws = [check_weight(w, i, what) for i, w in enumerate(weights)]
    if sum(ws) <= 0:
        raise ValueError(f"{what}: total weight is {sum(ws)}; it must be positive")
    return ws


def compute_dtype(name: str, t: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 tensors, float64 for float64 ones.

    Raises:
        ValueError: ``t`` is not a floating tensor.
    """
    if not t.is_floating_point():
        raise ValueError(
            f"'{name}' has dtype {t.dtype}; server optimizers need floating tensors"
            " (average integer buffers with weighted_mean)"
        )
    return torch.promote_types(t.dtype, torch.float32)


# ----------------------------------------------------------------------------- streaming


class Aggregator(Protocol):
    """Folds client updates into one result, one update at a time."""

    def add(self, update: Mapping[str, Tensor], weight: float) -> None:
        """Takes one client's update and its weight (usually its example count)."""
        ...

    def result(self) -> Arrays:
        """The aggregate of every update added."""
        ...


class RunningMean:
    """Running example-weighted mean Σ_k w_k·(u_k − b) / Σ_k w_k of named tensors.

    Holds one sum per tensor, whatever the number of updates.

    Args:
        what: Name used in error messages.
        reference: Names, shapes and dtypes every update must have; the first update's when
            None.
        base: ``b``, subtracted from every update before weighting (the global parameters
            for a pseudo-gradient); None for a plain mean.
        keep_dtype: Cast the result back to the reference's dtype, rounding integer tensors
            (a mean of parameters); else return it in the compute dtype (a pseudo-gradient).
    """

    def __init__(
        self,
        what: str,
        reference: Mapping[str, Tensor] | None = None,
        base: Mapping[str, Tensor] | None = None,
        keep_dtype: bool = True,
    ) -> None:
        self.what = what
        self.ref: Mapping[str, Tensor] | None = reference
        self.base = base
        self.keep_dtype = keep_dtype
        self.count = 0
        self.total = 0.0
        self._sums: Arrays = {}
        self._dtypes: dict[str, torch.dtype] = {}
        if reference is not None:
            self._start(reference)

    def _start(self, ref: Mapping[str, Tensor]) -> None:
        self.ref = ref
        for name, t in ref.items():
            if self.base is not None or not self.keep_dtype:
                cd = compute_dtype(name, t)
            elif t.is_floating_point():
                cd = torch.promote_types(t.dtype, torch.float32)
            else:
                cd = torch.float64
            self._dtypes[name] = cd
            self._sums[name] = torch.zeros(t.shape, dtype=cd, device=t.device)

    def add(self, update: Mapping[str, Tensor], weight: float) -> None:
        """Adds ``weight·(update − base)`` to the running sums.

        Raises:
            ValueError: A bad weight, or names or shapes that differ from the reference.
        """
        k = self.count
        w = check_weight(weight, k, self.what)
        if self.ref is None:
            self._start(update)
        ref = self.ref
        assert ref is not None
        versus = "params" if self.base is not None else "update 0"
        check_keys(ref, update, f"{self.what}: update {k} vs {versus}")
        for name, r in ref.items():
            t = update[name]
            check_shape(r, t, f"{self.what}: update {k} '{name}'")
            acc, cd = self._sums[name], self._dtypes[name]
            x = t.to(device=r.device, dtype=cd)
            if self.base is not None:
                x = x - self.base[name].to(device=r.device, dtype=cd)
            acc += x * w
        self.count += 1
        self.total += w

    def add_sum(self, total: Mapping[str, Tensor], weight: float, count: int) -> None:
        """Adds ``count`` updates already weighted and summed, Σ_k w_k·(u_k − b) (SecAgg+).

        Raises:
            ValueError: No reference yet, or a bad total weight.
        """
        if self.ref is None:
            raise ValueError(f"{self.what}: a sum needs the reference tensors first")
        w = check_weight(weight, self.count, self.what)
        for name, acc in self._sums.items():
            acc += total[name].to(device=acc.device, dtype=acc.dtype)
        self.count += count
        self.total += w

    def result(self) -> Arrays:
        """The mean of the updates added so far (new tensors).

        Raises:
            ValueError: No updates, or a total weight that is not positive.
        """
        if self.count == 0:
            raise ValueError(f"{self.what}: no updates to aggregate")
        if self.total <= 0:
            raise ValueError(f"{self.what}: total weight is {self.total}; it must be positive")
        assert self.ref is not None
        out: Arrays = {}
        for name, acc in self._sums.items():
            mean = acc / self.total
            if self.keep_dtype:
                ref = self.ref[name]
                mean = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
            out[name] = mean
        return out


def mean_delta(params: Mapping[str, Tensor], what: str = "pseudo_gradient") -> RunningMean:
    """A streaming pseudo-gradient Δ = Σ_k (n_k/n)(θ_k − θ) (see :func:`pseudo_gradient`)."""
    for name, p in params.items():
        compute_dtype(name, p)  # integer parameters are refused at once
    return RunningMean(what, reference=params, base=params, keep_dtype=False)


class Buffered:
    """Keeps every update and aggregates them at the end with a batch function.

    For aggregators that need all updates at once (a coordinate-wise median, Krum): the
    same ``add``/``result`` interface as the streaming ones, at the memory of every update.

    Args:
        params: The global parameters θ.
        fn: ``(params, updates, weights) -> Δ``, e.g. :func:`pseudo_gradient`.
    """

    def __init__(
        self,
        params: Mapping[str, Tensor],
        fn: Callable[[Mapping[str, Tensor], list[Mapping[str, Tensor]], list[float]], Arrays],
    ) -> None:
        self.params = params
        self.fn = fn
        self.updates: list[Mapping[str, Tensor]] = []
        self.weights: list[float] = []

    def add(self, update: Mapping[str, Tensor], weight: float) -> None:
        """Keeps the update and its weight."""
        self.updates.append(update)
        self.weights.append(weight)

    def result(self) -> Arrays:
        """``fn(params, updates, weights)``."""
        return self.fn(self.params, self.updates, self.weights)


# ----------------------------------------------------------------------------- batch


def weighted_mean(
    updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """Example-weighted mean Σ_k w_k·u_k / Σ_k w_k of named tensors.

    Floating tensors are summed in float32 (float64 for float64) and cast back to the dtype of
    the first update; integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are summed in
    float64 and rounded.

    Args:
        updates: One ``name -> tensor`` mapping per client, all with the same names and shapes.
        weights: One non-negative weight per update (usually its example count n_k).

    Returns:
        A new ``name -> tensor`` dict on the device of the first update.

    Raises:
        ValueError: No updates, bad weights (negative, non-finite, total not positive, wrong
            count), or names/shapes that differ between updates.
    """
    if len(updates) == 0:
        raise ValueError("weighted_mean: no updates to aggregate")
    ws = check_weights(weights, len(updates), "weighted_mean")
    acc = RunningMean("weighted_mean")
    for u, w in zip(updates, ws, strict=True):
        acc.add(u, w)
    return acc.result()


def pseudo_gradient(
    params: Mapping[str, Tensor],
    updates: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
) -> dict[str, Tensor]:
    """Pseudo-gradient Δ = Σ_k (n_k/n)(θ_k − θ) (Reddi et al. 2021, Algorithm 1).

    Differences are taken before weighting, which keeps small changes of large float32
    weights exact.

    Args:
        params: Current global parameters θ.
        updates: Client parameters θ_k after local training, same names and shapes as ``params``.
        weights: Example counts n_k (or any non-negative weights).

    Returns:
        Δ per name, in float32 (float64 for float64 parameters) on each parameter's device.

    Raises:
        ValueError: No updates, bad weights, integer parameters, or mismatched names/shapes.
    """
    if len(updates) == 0:
        raise ValueError("pseudo_gradient: no updates to aggregate")
    ws = check_weights(weights, len(updates), "pseudo_gradient")
    for k, u in enumerate(updates):
        check_keys(params, u, f"pseudo_gradient: update {k} vs params")
    acc = mean_delta(params)
    for u, w in zip(updates, ws, strict=True):
        acc.add(u, w)
    return acc.result()


def update_norm(params: Mapping[str, Tensor], origin: Mapping[str, Tensor]) -> float:
    """The L2 norm of ``params − origin`` over every tensor, ``√(Σ_k ‖θ_k − θ0_k‖²)``.

    A run's drift from its starting point (``update_norm`` of the FedAvg family and FedSDR:
    ‖θ_t − θ_0‖ of the global trainable tensors), summed in float64.

    Raises:
        ValueError: The two hold other names or shapes.
    """
    check_keys(origin, params, "update_norm")
    total = 0.0
    for k, ref in origin.items():
        check_shape(ref, params[k], f"update_norm: {k!r}")
        d = params[k].detach().to("cpu", torch.float64) - ref.detach().to("cpu", torch.float64)
        total += float((d * d).sum())
    return math.sqrt(total)


# ----------------------------------------------------------------------------- one round


class RoundSum(Protocol[T_co]):
    """One round's aggregate of the updates that replies carry, as the server step needs it."""

    def fold(self, reply: Message, field: str) -> None:
        """Adds one client's reply (its ``field``)."""
        ...

    def add_sum(self, total: Mapping[str, Tensor], extra: float, count: int) -> None:
        """Adds the sum of ``count`` clients' vectors and of their last coordinate (SecAgg+)."""
        ...

    def close(self) -> T_co | None:
        """Ends the round: what the server step applies, or None to leave the model as it is."""
        ...


def by_size(reply: Message) -> float:
    """A reply's weight in the example-weighted mean: its ``num_examples``."""
    return meta_number(reply, "num_examples")


def equal_weight(reply: Message) -> float:
    """The same weight for every reply (public weights: every client counts once)."""
    return 1.0


class ReplySum:
    """An :class:`Aggregator` (the mean, or a robust rule) fed from replies: a :class:`RoundSum`.

    Args:
        acc: The aggregator, e.g. :func:`mean_delta` of the global parameters.
        weight: A reply's weight (default: its example count).
    """

    def __init__(self, acc: Aggregator, weight: Callable[[Message], float] = by_size) -> None:
        self.acc = acc
        self.weight = weight
        self.count = 0

    def fold(self, reply: Message, field: str) -> None:
        """Adds ``reply.arrays[field]`` at the reply's weight."""
        self.acc.add(reply.arrays[field], self.weight(reply))
        self.count += 1

    def add_sum(self, total: Mapping[str, Tensor], extra: float, count: int) -> None:
        """Adds a SecAgg+ sum ``Σ r_k·u_k`` of total weight ``extra = Σ r_k``.

        Raises:
            TypeError: The aggregator is not a running sum (a robust rule needs every update).
        """
        if not isinstance(self.acc, RunningMean):
            raise TypeError(f"SecAgg+ cannot fold into {type(self.acc).__name__}: not a sum")
        self.acc.add_sum(total, extra, count)
        self.count += count

    def close(self) -> Arrays | None:
        """The aggregate, or None when no update came."""
        return self.acc.result() if self.count else None


class SecureTotal(Protocol):
    """What a secure sum reveals to the server (see :class:`fedfm.core.secagg.SecureSum`)."""

    total: Arrays
    extra: float
    count: int
    clients: list[str]

    def metrics(self) -> dict[str, float]:
        """The round's figures of the protocol."""
        ...


class SecureSummer(Protocol):
    """A protocol by which the server learns only the sum of the update messages' vectors."""

    def sum(
        self, fed: Federation, messages: Mapping[str, Message], base: Mapping[str, Tensor]
    ) -> SecureTotal:
        """Runs one round of the protocol around the update messages."""
        ...


@dataclass
class Gathered(Generic[T]):
    """What one aggregation step gathered.

    Attributes:
        result: What the server step applies (Δ for a server optimizer), or None: leave the
            model as it is (no update came, or DP-FedAvg skipped the round).
        clients: The clients whose updates the sum holds, in the order they came.
        metrics: The secure sum's figures (empty without SecAgg+).
    """

    result: T | None
    clients: list[str]
    metrics: dict[str, float]


def require_replies(fed: Federation, got: int, asked: int, min_clients: int) -> None:
    """Fails the round when fewer than ``min(min_clients, asked)`` clients answered.

    Raises:
        TooFewClientsError: Too few survivors.
    """
    if got < min(min_clients, asked):
        raise TooFewClientsError(
            f"round {fed.rnd}: only {got} of {asked} clients answered, min_clients={min_clients}"
        )


def aggregate_round(
    fed: Federation,
    messages: Mapping[str, Message],
    field: str,
    base: Mapping[str, Tensor],
    acc: RoundSum[T],
    min_clients: int,
    like: Templates | None = None,
    secure: SecureSummer | None = None,
    each: Callable[[str, Message], None] | None = None,
) -> Gathered[T]:
    """One round's aggregation step: replies into ``acc``, at least ``min_clients``, the result.

    Every algorithm whose server step sums client updates calls this one function (through
    :meth:`fedfm.algorithms.base.Algorithm.aggregate`, which picks ``acc`` and ``secure``
    for the run's privacy): the plain or robust mean, DP-FedAvg's clipped and noised sum and
    SecAgg+'s masked sum all go through it.

    Args:
        fed: The federation.
        messages: Client id -> the update message.
        field: The reply field that carries the update.
        base: The tensors ``field`` is compared with (its shapes; under SecAgg+ clients send
            ``reply − sent``).
        acc: This round's sum.
        min_clients: Fewer valid replies fail the round (``clients.min_clients``).
        like: Templates the replies' array fields must match.
        secure: SecAgg+: the server learns only the sum (``each`` then sees no reply).
        each: Called with every reply after it is folded (losses, cosines, counts).

    Returns:
        The closed sum, the clients it holds and the secure sum's figures.

    Raises:
        TooFewClientsError: Fewer than ``min_clients`` valid replies (or a failed secure sum).
    """
    clients: list[str] = []
    metrics: dict[str, float] = {}
    if secure is not None:
        got = secure.sum(fed, messages, base)
        acc.add_sum(got.total, got.extra, got.count)
        clients, metrics = list(got.clients), got.metrics()
    else:
        for cid, reply in fed.stream(messages, like):
            acc.fold(reply, field)
            clients.append(cid)
            if each is not None:
                each(cid, reply)
    require_replies(fed, len(clients), len(messages), min_clients)
    return Gathered(acc.close(), clients, metrics)
