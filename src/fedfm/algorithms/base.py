"""What an algorithm supplies to the engine, and the algorithm registry.

An algorithm is one file holding its config, its server half and its client half
(DESIGN.md principle 1). The engine owns the round loop; the server half (an
:class:`Algorithm`) supplies steps: ``setup`` (one-off phases before round 1), ``round``,
``evaluate`` and ``finish``. The client half is its own object, a :class:`ClientHalf`
declared as ``Algorithm.Client`` and built by :func:`client_half` from the config alone, on
every runtime: it never sees the server half, so a handler that reaches for server state
fails the same way in the server's process (embedded) as in another one (Flower).

A variant that only sets part of another algorithm's config is a preset of it
(:func:`fedfm.algorithms.presets.register_preset`), not a subclass.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sized
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict
from torch import Tensor

from fedfm.algorithms.lora_clients import lora_spec
from fedfm.core.aggregate import Gathered, RoundSum, aggregate_round, require_replies
from fedfm.core.artefacts import Artefacts
from fedfm.core.federation import Federation, Handler, Templates
from fedfm.core.messages import Message, MessageKind
from fedfm.core.optim import ServerOptConfig, ServerOptimizer
from fedfm.core.privacy import PrivacyLedger
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secagg import ClientSecAgg, SecAgg, resolve, secure_kinds
from fedfm.core.stages import Stage, stage_at
from fedfm.core.userdp import ClientDP, UserDP
from fedfm.errors import ConfigError, FedfmError
from fedfm.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from fedfm.config import RunConfig
    from fedfm.tasks.base import Task, TaskConfig


class AlgoConfig(BaseModel):
    """Base of algorithm configs: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ServerStateError(FedfmError, AttributeError):
    """A client half read an attribute it does not hold (server state, most likely)."""

    def __init__(self, half: type, name: str) -> None:
        super().__init__(
            f"client half {half.__qualname__} has no attribute '{name}': a client half holds"
            " only what it built from the config (cfg, task, run); server state reaches a"
            " client in its message"
        )


class ClientHalf:
    """An algorithm's client half: its handlers, one per message kind.

    Built by :func:`client_half` from the validated config, the task and the run config, in
    every process that serves clients, and never from the server half. A handler uses its
    :class:`~fedfm.core.federation.ClientContext`, the message and what this object built
    from the config; a model this process shares with the server half comes from
    :attr:`fedfm.tasks.base.Task.scratch` and is loaded from the message or the client's
    state before it is read. Reading an attribute the half does not have raises
    :class:`ServerStateError`, on every runtime alike.

    Args:
        cfg: The algorithm's validated config.
        task: The task (client data, shared frozen models, scratch modules).
        run: The run config.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        self.cfg = cfg
        self.task = task
        self.run = run

    def handlers(self) -> dict[str, Handler]:
        """Message kind -> client handler."""
        raise NotImplementedError

    if not TYPE_CHECKING:  # at run time only: mypy still checks every attribute by name

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):  # copy, pickle and friends probe dunders
                raise AttributeError(name)
            raise ServerStateError(type(self), name)


def client_half(
    algorithm: type[Algorithm], cfg: AlgoConfig, task: Task, run: RunConfig
) -> ClientHalf:
    """The client half of ``algorithm`` (its ``Client``), built from the config alone.

    The engine and both runtimes build client halves here and nowhere else.
    """
    return algorithm.Client(cfg, task, run)


def shared_model(task: Task, seed: int, **overrides: Any) -> nn.Module:
    """This process's one instance of ``task.build_model(seed, **overrides)``.

    Both halves of an algorithm use it as scratch (each loads its tensors before use), so a
    process holds one copy whatever the number of clients it serves.
    """
    key = "model:" + json.dumps([seed, overrides], sort_keys=True, default=str)
    return task.scratch.get(key, lambda: task.build_model(seed=seed, **overrides))


def user_dp_of(run: RunConfig, num_clients: int, ledger: PrivacyLedger) -> UserDP | None:
    """The run's client-level DP-FedAvg, or None without ``privacy.user_level``."""
    cfg = run.privacy.user_level
    return None if cfg is None else UserDP(cfg, run, num_clients, ledger)


def client_user_dp(task: Task, run: RunConfig) -> UserDP | None:
    """What a client needs of DP-FedAvg: the noise it adds in client mode, else None.

    Built from the config (calibration, bound, the client's share of the noise) with a
    ledger of its own: the server's ledger, bound and secret stay with the server half.
    """
    cfg = run.privacy.user_level
    if cfg is None or cfg.mode != "client":
        return None
    ledger = PrivacyLedger(run.privacy.delta, run.privacy.accountant, run.privacy.noise)
    return user_dp_of(run, len(task.client_ids()), ledger)


def secagg_of(algo: type[Algorithm], run: RunConfig, num_clients: int) -> SecAgg | None:
    """The run's SecAgg+ parameters, or None when ``privacy.secure_aggregation`` is none.

    Raises:
        ConfigError: The algorithm's server step is not a sum of client vectors, server-side
            DP noise, or parameters that do not fit the run's clients (:func:`resolve`).
    """
    if run.privacy.secure_aggregation == "none":
        return None
    field = "privacy.secure_aggregation"
    if not algo.secure_fields:
        raise ConfigError(
            field,
            f"algorithm '{run.algorithm}' has no server step that is a weighted sum of client"
            " vectors, the only thing SecAgg+ computes",
        )
    level = run.privacy.user_level
    if level is not None and level.mode == "server":
        raise ConfigError(
            field,
            "server-side DP noise needs every raw update on the server, which SecAgg+ hides;"
            " use privacy.user_level.mode=client (distributed DP)",
        )
    if run.comm.uplink is not None:
        raise ConfigError(
            "comm.uplink",
            "under privacy.secure_aggregation=secagg+ updates travel as masked integers mod the"
            " modulus; a codec on them would break the masks' cancellation",
        )
    c = run.clients
    if level is not None:  # Poisson sampling: the expected count, and at most every client
        sampled, most = max(1, round(c.fraction * num_clients)), num_clients
    else:
        sampled = min(num_clients, max(c.min_clients, round(c.fraction * num_clients)))
        most = sampled
    ddg = level is not None and run.privacy.secagg.dp_noise == "discrete_gaussian"
    return resolve(run.privacy.secagg, sampled, most, weighted=level is None, ddg=ddg)


def client_handlers(half: ClientHalf, kinds: dict[str, MessageKind]) -> dict[str, Handler]:
    """The client half's handlers, wrapped by the run's privacy.

    Inside, client-side DP-FedAvg (:class:`~fedfm.core.userdp.ClientDP`) privatises each
    update reply; around it, SecAgg+'s client half masks what leaves. The client half itself
    never mentions either.
    """
    inner = half.handlers()
    run = half.run
    dp = client_user_dp(half.task, run)
    ddg = dp is not None and dp.wants_ddg  # then SecAgg+'s encoding clips and noises
    if dp is not None and not ddg:
        inner = ClientDP(dp).handlers(inner, kinds)
    if run.privacy.secure_aggregation == "none":
        return inner
    # The client checks the server's threshold against its own config, share by share.
    sa = SecAgg(run.privacy.secagg, 0, 0, weighted=run.privacy.user_level is None)
    return ClientSecAgg(sa, dp if ddg else None).handlers(inner, kinds)


class Algorithm:
    """Base of every algorithm: defaults for the optional steps, nothing else.

    Args:
        cfg: The algorithm's validated config (``Config`` of the subclass).
        task: The task (data, models, evaluation).
        run: The run config (seed, local training, client sampling).

    Attributes:
        Config: The algorithm's config model.
        Client: Its client half (built by :func:`client_half`, never by the server half).
        messages: The message kinds it uses, with their declared fields.
        personalised: Whether evaluation is per client (reported as mean and worst client).
        privacy: The run's privacy ledger: register every DP mechanism the algorithm runs
            (the engine checkpoints it and writes ``privacy.json``).
        artefacts: Files for the run folder (distilled sets, selection logs, synthetic data);
            the engine publishes, checkpoints and lists them.
        update_kinds: The kinds whose replies carry the updates it aggregates (and, under
            client-side DP-FedAvg, nothing else); empty: no ``privacy.user_level``.
        user_dp: The run's client-level DP-FedAvg (:mod:`fedfm.core.userdp`), or None.
        secure_fields: Update kind -> the field whose weighted sum its server step is: the
            kinds SecAgg+ (``privacy.secure_aggregation``) may sum; empty: it refuses it.
        secagg: The run's SecAgg+ parameters, or None.
    """

    Config: ClassVar[type[AlgoConfig]] = AlgoConfig
    Client: ClassVar[type[ClientHalf]] = ClientHalf
    messages: ClassVar[tuple[MessageKind, ...]] = ()
    personalised: ClassVar[bool] = False
    update_kinds: ClassVar[tuple[str, ...]] = ()
    secure_fields: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "handlers" in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__}.handlers: client handlers belong to the client half"
                f" ({cls.__qualname__}.Client, a ClientHalf built from the config alone)"
            )

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        self.cfg = cfg
        self.task = task
        self.run = run
        self.privacy = PrivacyLedger(run.privacy.delta, run.privacy.accountant, run.privacy.noise)
        self.artefacts = Artefacts()
        self.user_dp = self._user_dp(task, run)
        self.secagg = secagg_of(type(self), run, len(task.client_ids()))
        if self.secagg is not None and self.user_dp is not None:
            self.user_dp.secure(self.secagg.threshold)  # distributed DP: ε against the server
        self._check_lora_options(task)

    #: The ``task.lora`` options the algorithm runs: ``client_ranks`` (mixed ranks) and
    #: ``freeze_a`` (FFA-LoRA), see :mod:`fedfm.algorithms.lora_clients`.
    lora_options: ClassVar[tuple[str, ...]] = ()

    def _check_lora_options(self, task: Task) -> None:
        spec = lora_spec(task)
        if spec is None:
            return
        for name, on in (("client_ranks", spec.mixed), ("freeze_a", spec.freeze_a)):
            if on and name not in self.lora_options:
                raise ConfigError(
                    f"task.lora.{name}",
                    f"algorithm '{self.run.algorithm}' does not run it (mixed ranks: fedavg,"
                    " fedprox; FFA-LoRA: fedavg, fedprox, dpsyn)",
                )

    def _user_dp(self, task: Task, run: RunConfig) -> UserDP | None:
        """DP-FedAvg when ``privacy.user_level`` asks for it and the algorithm aggregates."""
        if run.privacy.user_level is not None and not self.update_kinds:
            raise ConfigError(
                "privacy.user_level",
                f"algorithm '{run.algorithm}' does not aggregate client updates by FedAvg;"
                " client-level DP-FedAvg needs one that does",
            )
        return user_dp_of(run, len(task.client_ids()), self.privacy)

    def message_kinds(self) -> dict[str, MessageKind]:
        """This run's message kinds by name (see :meth:`kinds_for`)."""
        return self.kinds_for(self.cfg, self.run)

    @classmethod
    def kinds_for(cls, cfg: AlgoConfig, run: RunConfig) -> dict[str, MessageKind]:
        """The message kinds by name of a run with this config.

        No instance is needed: a process that only serves clients reads them too. Under
        client-side DP-FedAvg the update kinds travel in their private form (only DP outputs
        and public fields go up); an algorithm whose own DP depends on its config overrides
        this.
        """
        kinds = kinds_of(cls)
        level = run.privacy.user_level
        if level is not None and level.mode == "client":
            for name in cls.update_kinds:
                kinds[name] = kinds[name].as_private()
        if run.privacy.secure_aggregation == "secagg+":
            kinds = secure_kinds(kinds, cls.secure_fields, dp=level is not None)
        return kinds

    @classmethod
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        """Refuses a task that lacks an optional capability this algorithm needs with ``cfg``.

        Called when the config is loaded, before any data is read; use
        :func:`fedfm.tasks.base.require` for each capability needed.

        Raises:
            ConfigError: A capability is missing, naming the config field that needs it.
        """

    @classmethod
    def stages(cls, cfg: AlgoConfig) -> tuple[Stage, ...]:
        """The named phases of this algorithm's rounds, in order (:mod:`fedfm.core.stages`).

        Empty (the default): every round is the same and ``rounds`` comes from the config.
        With stages the engine derives ``rounds`` from them when the config does not give it
        and refuses more.
        """
        return ()

    @classmethod
    def stages_origin(cls) -> str:
        """The config fields that set the stages' round counts (named in errors)."""
        return ""

    def stage(self, rnd: int) -> str | None:
        """The name of the stage round ``rnd`` belongs to (``None``: round 0 or no stage)."""
        return stage_at(self.stages(self.cfg), rnd)

    # ----- server half -----
    def setup(self, fed: Federation) -> dict[str, float]:
        """One-off phase before round 1 (round 0). Returns metrics to log."""
        return {}

    def round(self, fed: Federation) -> dict[str, float]:
        """One round (``fed.rnd``): talk to clients, update the server state, return metrics."""
        raise NotImplementedError

    def evaluate(self, fed: Federation) -> dict[str, Any]:
        """Evaluation after a round; may message clients for personalised metrics.

        A ``"per_client"`` entry (client id -> metric -> value) is logged by the engine to
        ``client_metrics.jsonl`` rather than to ``metrics.jsonl``.
        """
        return {}

    def finish(self, fed: Federation) -> dict[str, float]:
        """One-off phase after the last round. Returns metrics for the summary."""
        return {}

    def export_adapter(self, folder: Path) -> bool:
        """Writes the global model's LoRA adapter in peft's format into ``folder``.

        Called by the engine once the run has finished (the run's ``adapter/``, which
        ``fedfm eval`` evaluates). Returns ``False``, writing nothing, when the algorithm's
        global model is not a LoRA adapter of a foundation model.
        """
        return False

    # ----- checkpointing -----
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Server state as (tensors, JSON-able metadata)."""
        return {}, {}

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""

    def secure_base(self) -> Mapping[str, Tensor] | None:
        """The tensors whose update SecAgg+ sums under DP; None: not stated.

        Their size is the distributed discrete Gaussian's dimension.
        """
        return None

    def bind_secure(self) -> None:
        """Plans the distributed discrete Gaussian once the update's size is known.

        Called when the run is built (:func:`fedfm.engine.build`), and at the first sample.

        Raises:
            ConfigError: The algorithm does not state its update's tensors, or the plan does
                not fit (:meth:`fedfm.core.userdp.UserDP.ddg_plan`).
        """
        dp, sa = self.user_dp, self.secagg
        if dp is None or sa is None or sa.ddg is not None or not dp.wants_ddg:
            return
        base = self.secure_base()
        if base is None:
            raise ConfigError(
                "privacy.secagg.dp_noise",
                f"algorithm '{self.run.algorithm}' does not run the distributed discrete"
                " Gaussian; use privacy.secagg.dp_noise=continuous",
            )
        plan = dp.ddg_plan(sum(t.numel() for t in base.values()))
        self.secagg = replace(sa, ddg=plan)
        dp.use_ddg(plan)

    # ----- helpers for subclasses -----
    def sample(self, fed: Federation, role: str | None = None) -> list[str]:
        """Clients for this round, by the run's sampling fraction.

        Under DP-FedAvg: Poisson sampling at that rate, the sampling its accountant assumes
        (:meth:`fedfm.core.userdp.UserDP.sample`).
        """
        if self.user_dp is not None:
            self.bind_secure()
            return self.user_dp.sample(fed)
        c = self.run.clients
        return fed.sample(c.fraction, role=role, min_clients=c.min_clients)

    def require(self, fed: Federation, replies: Sized | int, asked: int) -> None:
        """Fails the round when fewer than ``min_clients`` answered.

        Args:
            fed: The federation.
            replies: The valid replies (or their number).
            asked: How many clients were asked.

        Raises:
            TooFewClientsError: Too few survivors.
        """
        got = replies if isinstance(replies, int) else len(replies)
        require_replies(fed, got, asked, self.run.clients.min_clients)

    def server_optimizer(
        self, cfg: ServerOptConfig, aggregator: AggregatorConfig
    ) -> ServerOptimizer:
        """The server optimizer of a summing algorithm (DP-FedAvg refuses a robust rule).

        Raises:
            ConfigError: A robust ``algo.aggregator`` under ``privacy.user_level``.
        """
        if self.user_dp is not None:
            self.user_dp.refuse_robust(aggregator)
        return ServerOptimizer(cfg, aggregator)

    def aggregate(
        self,
        fed: Federation,
        messages: Mapping[str, Message],
        field: str,
        base: Mapping[str, Tensor],
        start: Callable[[Mapping[str, Tensor]], RoundSum[Any]],
        like: Templates | None = None,
        each: Callable[[str, Message], None] | None = None,
    ) -> Gathered[Any]:
        """One round's aggregation step (:func:`~fedfm.core.aggregate.aggregate_round`).

        ``start(base)`` is the algorithm's own sum. The run's privacy wraps it here, and only
        here: under DP-FedAvg the messages carry the round's bound and the sum is the clipped,
        noised one (:meth:`fedfm.core.userdp.UserDP.accumulator`, its result Δ), checked
        against the template of ``field`` alone; under SecAgg+ the server learns only the sum.

        Args:
            fed: The federation.
            messages: Client id -> update message.
            field: The reply field carrying the update.
            base: What ``field`` is compared with (Δ = field − base).
            start: The algorithm's sum of a round without DP-FedAvg.
            like: Templates of the replies' array fields.
            each: Called with every reply the server sees (not under SecAgg+).

        Raises:
            TooFewClientsError: Fewer than ``min_clients`` valid replies.
        """
        dp = self.user_dp
        acc: RoundSum[Any]
        if dp is None:
            acc = start(base)
        else:
            messages, acc = dp.configure(messages), dp.accumulator(base)
            like = {field: like[field]} if like is not None and field in like else None
        return aggregate_round(
            fed, messages, field, base, acc, self.run.clients.min_clients, like, self.secagg, each
        )


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "algorithm")


def kinds_of(algo: type[Algorithm]) -> dict[str, MessageKind]:
    """The algorithm's message kinds by name."""
    return {k.name: k for k in algo.messages}
