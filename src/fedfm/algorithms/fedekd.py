"""FedeKD: private and proxy models with energy-gated backward distillation, and its baselines.

Paper: Quang-Huy Nguyen, Jiaqi Wang, Wei-Shinn Ku, "FedeKD: Energy-Based Gating for Robust
Federated Knowledge Distillation under Heterogeneity", arXiv:2605.05553.

Every client k keeps a high-capacity private model f_k that never leaves it (architectures may
differ per client) and a lightweight proxy g_k whose architecture all clients share. A round
has the paper's three sequential stages (Sec. 3.2, Algorithm 1):

1. forward distillation: f_k frozen, g_k (initialised from the global proxy) trained on the
   local data to mimic f_k (KL on softmax for classification, squared error for regression);
2. proxy aggregation: the server aggregates the proxies into the global proxy g (any server
   optimizer of :mod:`fedfm.core.optim`; the paper uses FedAvg) and sends it back;
3. energy-gated backward distillation: f_k is updated with the supervised loss plus
   λ · Σ w·D(f_k(x), g(x)) / Σ w, where the trust weight w = gate(E(x)) falls as the
   private-proxy energy E rises (eq. (1) entropy-normalised symmetric KL for classification,
   eq. (2) half squared error for regression; :mod:`fedfm.core.kd`).

So a round is two exchanges: ``forward`` (global proxy down, local proxy up) and ``backward``
(new global proxy down, nothing but scalars up). Only proxy tensors ever travel; the audit
ledger shows it.

Baselines in this file: ``fedkd-ungated`` (a preset of FedeKD with ``gate: ungated``: the
same private/proxy mutual distillation with weight 1 for every sample, in the style of FML,
Shen et al. 2020, "Federated Mutual Learning", and FedKD, Wu et al. 2022,
"Communication-efficient federated learning via knowledge distillation"; their extra terms,
such as FedKD's adaptive loss scaling and hidden-state distillation, are not included, so
the only difference from FedeKD is the gate) and
``local-private`` (each client trains its own private architecture alone, the local-only
reference that FedeKD's negative transfer is measured against). FedAvg, FedProx and the
shared-architecture local-only baseline live in :mod:`fedfm.algorithms.fedavg`.

Choices of ours (the paper does not make them; each is a config option):
    * The gate: ``sigmoid``, w = sigmoid(−β·z) with z the batch-standardised energy
      (:func:`fedfm.core.kd.sigmoid_gate`); weights are detached. The paper's text available
      here stops before eq. (3), so the gate's form is ours. ``level`` (also ours) normalises
      by a running mean of the client's energy kept in its state across rounds, so a whole
      unreliable batch can be down-weighted; ``oracle`` (a bound for studies of a simulated
      concept shift, ``task.shift``) gives weight 0 to exactly the client's relabelled rows.
    * β = 1, λ = 0.5: chosen over β ∈ {1, 2, 4, 8} × λ ∈ {0.5, 1, 2} by the rule of the
      reproduction study (best mean rank of mean-client negative transfer on the clients'
      validation splits, never the test numbers; ``docs/fedekd_skew.md``); λ was 1 before.
    * Distillation temperature T = 1 in both directions (energies always use T = 1, as eq. (1)).
    * The forward stage is pure distillation (``forward_ce = 0``, as the paper describes it);
      ``forward_ce > 0`` adds that weight of the supervised loss on labels to the proxy's loss.
    * Each stage runs the run's local-training budget (``train.steps`` or ``train.epochs``)
      unless ``forward_steps`` / ``backward_steps`` are set; a fresh local optimizer per stage.
    * With client sampling, the backward stage goes to the clients whose forward reply was
      accepted (the paper has every client take part every round, where the two coincide).
    * Private models are initialised with a seed derived from (run seed, client id) at first
      use; ``private_archs`` is cycled over the clients in their stable order.
    * Aggregation weights are the clients' training-set sizes; ``aggregator`` may replace the
      weighted mean of the proxy updates by a robust rule (:mod:`fedfm.core.robust`).
    * Evaluation is personalised: each client's private model on its local test split
      (``local/``), on the global test set (``test/``) and, when the task holds out a
      validation split (``task.local_val_fraction``), on it (``val/``), mean and worst client;
      the headline metric is the mean client on the global test set (as for the local-only
      baseline), and the global proxy is reported on the global test set (``proxy/``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn
from typing_extensions import override

from fedfm.algorithms.base import (
    ALGORITHMS,
    AlgoConfig,
    Algorithm,
    ClientHalf,
    shared_model,
)
from fedfm.algorithms.presets import register_preset
from fedfm.config import RunConfig
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.groups import get_group, join_groups
from fedfm.core.kd import (
    GATES,
    GateContext,
    gated_kd,
    half_squared_error_energy,
    kd_kl,
    kd_mse,
    symmetric_kl_energy,
)
from fedfm.core.messages import EVAL_EXAMPLES, Message, MessageKind, MetaSpec
from fedfm.core.optim import ServerOptConfig
from fedfm.core.replies import MetricMean, meta_number, summarise_by_prefix, weighted_mean_metric
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secagg import refuse_non_sum
from fedfm.core.seeding import derive_seed
from fedfm.core.train import get_params, local_round, set_params
from fedfm.core.userdp import UPDATE_META
from fedfm.errors import ConfigError, config_fields
from fedfm.tasks.base import Task

FORWARD = MessageKind(
    "forward",
    down_arrays=("proxy",),
    down_meta=("clip",),
    up_arrays=("proxy",),
    up_meta=("num_examples", "loss", "clip_bit"),
    meta_specs=UPDATE_META,
    dp_fields=("proxy", "clip_bit"),  # under client-side DP-FedAvg
)
BACKWARD = MessageKind(
    "backward",
    down_arrays=("proxy",),
    up_meta=(
        "num_examples",
        "loss",
        "energy",
        "gate_min",
        "gate_max",
        "gate_shifted",
        "gate_kept",
    ),
    # Sent only when the backward stage distils (λ > 0); gate weights are non-negative. The
    # mean weight on a shifted client's relabelled rows and on its other rows come only from a
    # client of a simulated concept shift (a measurement of the gate, not part of the method).
    meta_specs={
        "energy": MetaSpec("float"),
        "gate_min": MetaSpec("float", ge=0),
        "gate_max": MetaSpec("float", ge=0),
        "gate_shifted": MetaSpec("float", ge=0),
        "gate_kept": MetaSpec("float", ge=0),
    },
)
LOCAL = MessageKind("local", up_meta=("num_examples", "loss"))
EVALUATE = MessageKind(
    "evaluate", up_meta=("num_examples", "metrics"), meta_specs={"num_examples": EVAL_EXAMPLES}
)


def arch_fields(path: str, arch: dict[str, Any]) -> dict[str, str]:
    """Config paths of the model arguments an architecture override sets (for errors)."""
    return {f"model.{k}": f"{path}.{k}" for k in arch}


def _one_default_arch() -> list[dict[str, Any]]:
    return [{}]


class FedeKDConfig(AlgoConfig):
    """FedeKD settings; ``(ours)`` marks defaults the paper does not fix."""

    proxy_arch: dict[str, Any] = Field(
        default_factory=dict,
        description="model overrides of the proxy, ONE architecture shared by every client",
    )
    private_archs: list[dict[str, Any]] = Field(
        default_factory=_one_default_arch,
        min_length=1,
        description="model overrides of the private models, cycled over clients",
    )
    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(
        default_factory=AggregatorConfig, description="how proxy updates are combined"
    )
    gate: str = Field("sigmoid", description="gate in fedfm.core.kd.GATES (ours: sigmoid)")
    beta: float = Field(1.0, ge=0, description="gate scale β (ours: 1, chosen on validation)")
    lam: float = Field(
        0.5,
        ge=0,
        description="weight λ of the backward distillation (ours: 0.5, chosen on validation)",
    )
    temperature: float = Field(1.0, gt=0, description="distillation temperature (ours: 1)")
    forward_ce: float = Field(0.0, ge=0, description="weight of label CE in the forward stage")
    forward_steps: int | None = Field(None, ge=1, description="None: the run's local budget")
    backward_steps: int | None = Field(None, ge=1, description="None: the run's local budget")

    @field_validator("proxy_arch", mode="before")
    @classmethod
    def _one_proxy(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            raise ValueError(
                f"must be one architecture shared by every client (got a list of {len(v)});"
                " per-client architectures belong in algo.private_archs"
            )
        return v

    @field_validator("gate")
    @classmethod
    def _known_gate(cls, v: str) -> str:
        GATES.get(v)  # UnknownNameError names algo.gate and the choices
        return v


class PrivateModels:
    """Every client's private model: its architecture, its weights in the client's state.

    One instance per architecture is kept per process and loaded with the weights of the
    client being served. A client without weights yet starts from a seed derived from
    (run seed, client id); ``archs`` is cycled over the clients in their stable order.

    Args:
        task: The task (model builder, client ids).
        seed: Run seed.
        archs: Model overrides of each private architecture.
    """

    def __init__(self, task: Task, seed: int, archs: list[dict[str, Any]]) -> None:
        self.task = task
        self.seed = seed
        self.archs = archs
        # A bad private architecture fails when the algorithm is built, naming its field.
        self.instances = []
        for i, arch in enumerate(archs):
            with config_fields(arch_fields(f"algo.private_archs.{i}", arch)):
                self.instances.append(task.build_model(seed=seed, **arch))

    def arch_of(self, cid: str) -> int:
        """Index of the client's private architecture in ``archs`` (cycled)."""
        return self.task.client_ids().index(cid) % len(self.archs)

    def load(self, ctx: ClientContext) -> nn.Module:
        """The client's private model with its weights (fresh ones on first use)."""
        arch = self.arch_of(ctx.cid)
        model = self.instances[arch]
        own = ctx.state.get_group("private")
        if not own:
            fresh = self.task.build_model(
                seed=derive_seed(self.seed, "private", ctx.cid) % 2**31, **self.archs[arch]
            )
            own = get_params(fresh)
        set_params(model, own)
        return model

    @staticmethod
    def save(ctx: ClientContext, model: nn.Module) -> None:
        """Keeps the private model's weights in the client's state."""
        ctx.state.set_group("private", get_params(model))


def evaluate_privates(
    task: Task, privates: PrivateModels, ctx: ClientContext, msg: Message
) -> Message:
    """One client's private model, evaluated three ways.

    On the global test set (``test/``), the local test split (``local/``) and, where the task
    holds one, the client's validation split (``val/``); a client of a simulated concept
    shift also reports its accuracy on the local test rows of the classes it relabels
    (``local/shifted_acc``).
    """
    model = privates.load(ctx)
    glob = task.evaluate(model, task.test_data())
    local_test = task.client_test_data(ctx.cid)
    loc = task.evaluate(model, local_test)
    metrics = {**{f"test/{k}": v for k, v in glob.items()}}
    metrics.update({f"local/{k}": v for k, v in loc.items()})
    swapped = task.relabelled(ctx.cid, local_test)  # under a simulated concept shift only
    if swapped is not None and task.num_examples(swapped):
        metrics["local/shifted_acc"] = task.evaluate(model, swapped)["acc"]
    val = task.client_val_data(ctx.cid)
    if val is not None:  # an empty split evaluates to no metrics
        metrics.update({f"val/{k}": v for k, v in task.evaluate(model, val).items()})
    n = task.num_examples(ctx.data)
    return Message("evaluate", meta={"num_examples": n, "metrics": metrics})


def summarise_privates(task: Task, fed: Federation) -> dict[str, Any]:
    """Server half of personalised evaluation: every client's private-model metrics.

    The headline metric is the mean client on the global test set.
    """
    replies = fed.broadcast(Message("evaluate"), fed.client_ids())
    per: dict[str, dict[str, float]] = {}
    for c, r in replies.items():
        metrics = r.meta["metrics"]
        assert isinstance(metrics, dict)
        per[c] = metrics
    out: dict[str, Any] = summarise_by_prefix(per)
    if f"test/{task.primary}" in out:
        out[task.primary] = out[f"test/{task.primary}"]
    out["per_client"] = per
    return out


def shared_proxy(task: Task, run: RunConfig, cfg: FedeKDConfig) -> nn.Module:
    """This process's proxy instance, shared by the server and client halves (scratch).

    A bad ``proxy_arch`` fails when the algorithm is built, naming its field.
    """
    with config_fields(arch_fields("algo.proxy_arch", cfg.proxy_arch)):
        return shared_model(task, run.seed, **cfg.proxy_arch)


def _fedekd_config(cfg: AlgoConfig) -> FedeKDConfig:
    assert isinstance(cfg, FedeKDConfig), type(cfg)
    return cfg


class FedeKDClient(ClientHalf):
    """FedeKD's client half: forward KD into the proxy, gated backward KD into the private model.

    The private model never leaves the client (its weights live in the client's state); the
    proxy instance is loaded from each message.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedeKDConfig = _fedekd_config(cfg)
        self.proxy = shared_proxy(task, run, self.cfg)
        self.privates = PrivateModels(task, run.seed, self.cfg.private_archs)

    @override
    def handlers(self) -> dict[str, Handler]:
        return {
            "forward": self.forward,
            "backward": self.backward,
            "evaluate": lambda ctx, msg: evaluate_privates(self.task, self.privates, ctx, msg),
        }

    def _divergence(self, student: Tensor, teacher: Tensor) -> Tensor:
        """Per-sample KD loss D [B]: KL(teacher ‖ student)·T², or squared error."""
        if self.task.kind == "regression":
            return kd_mse(student, teacher, reduction="none")
        return kd_kl(student, teacher, self.cfg.temperature, reduction="none")

    def _energy(self, private_out: Tensor, proxy_out: Tensor) -> Tensor:
        if self.task.kind == "regression":
            return half_squared_error_energy(private_out, proxy_out)
        return symmetric_kl_energy(private_out, proxy_out)

    def forward(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 1: the private model (frozen) teaches the proxy on the local data."""
        teacher = self.privates.load(ctx).eval()
        proxy = self.proxy
        glob = msg.arrays["proxy"]
        set_params(proxy, glob)
        w_ce = self.cfg.forward_ce

        def loss_fn(model: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
            sup, out = self.task.loss(model, batch)
            return w_ce * sup, out

        def kd(model: nn.Module, batch: Any, out: Tensor) -> Tensor:
            with torch.no_grad():
                t_out = teacher(batch[0])
            return self._divergence(out, t_out).mean()

        res = local_round(
            ctx,
            proxy,
            self.run.train,
            steps=self.cfg.forward_steps,
            purpose="forward",
            loss_fn=loss_fn,
            extra_loss=kd,
        )
        trained = get_params(proxy, list(glob))
        n = self.task.num_examples(ctx.data)
        return Message("forward", {"proxy": trained}, {"num_examples": n, "loss": res.loss})

    def backward(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 3: supervised loss + λ·energy-gated KD from the global proxy."""
        private = self.privates.load(ctx)
        proxy = self.proxy.eval()
        set_params(proxy, msg.arrays["proxy"])
        stats: dict[str, list[float]] = {"energy": [], "w_min": [], "w_max": []}
        shifted = torch.tensor(sorted(self.task.shifted(ctx.cid)), dtype=torch.long)
        weights = {"shifted": [0.0, 0], "kept": [0.0, 0]}  # sum of weights, rows
        level = ctx.state.meta.get("energy_level")  # the level gate's running mean energy
        gate_ctx = GateContext(level=None if level is None else float(level))

        def kd(model: nn.Module, batch: Any, out: Tensor) -> Tensor:
            with torch.no_grad():
                g_out = proxy(batch[0])
            energy = self._energy(out, g_out)
            relabelled = (
                torch.isin(batch[1].cpu(), shifted) if self.task.kind == "classification" else None
            )
            gate_ctx.unreliable = relabelled
            loss, w = gated_kd(
                self._divergence(out, g_out), energy, self.cfg.gate, self.cfg.beta, gate_ctx
            )
            stats["energy"].append(float(energy.detach().mean()))
            stats["w_min"].append(float(w.min()))
            stats["w_max"].append(float(w.max()))
            if relabelled is not None and len(shifted):
                w_cpu = w.detach().cpu()
                for key, mask in (("shifted", relabelled), ("kept", ~relabelled)):
                    weights[key][0] += float(w_cpu[mask].sum())
                    weights[key][1] += int(mask.sum())
            return self.cfg.lam * loss

        res = local_round(
            ctx,
            private,
            self.run.train,
            steps=self.cfg.backward_steps,
            purpose="backward",
            extra_loss=kd if self.cfg.lam > 0 else None,
        )
        self.privates.save(ctx, private)
        if gate_ctx.level is not None:
            ctx.state.meta["energy_level"] = gate_ctx.level
        meta: dict[str, Any] = {"num_examples": self.task.num_examples(ctx.data), "loss": res.loss}
        if stats["energy"]:
            meta["energy"] = sum(stats["energy"]) / len(stats["energy"])
            meta["gate_min"] = min(stats["w_min"])
            meta["gate_max"] = max(stats["w_max"])
        for key, (total, rows) in weights.items():
            if rows:
                meta[f"gate_{key}"] = total / rows
        return Message("backward", meta=meta)


class FedeKD(Algorithm):
    """FedeKD (Nguyen, Wang, Ku 2026): forward proxy KD, proxy aggregation, gated backward KD."""

    Config = FedeKDConfig
    Client = FedeKDClient
    messages = (FORWARD, BACKWARD, EVALUATE)
    update_kinds = ("forward", "backward")
    secure_fields: ClassVar[dict[str, str]] = {"forward": "proxy"}  # the proxy's weighted sum
    personalised = True

    def __init__(self, cfg: FedeKDConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedeKDConfig = cfg
        if task.kind not in ("classification", "regression"):
            raise ConfigError(
                "algorithm", f"FedeKD needs a classification or regression task, not {task.kind}"
            )
        if cfg.gate == "oracle" and not any(task.shifted(c) for c in task.client_ids()):
            raise ConfigError(
                "algo.gate", "the oracle gate needs a simulated concept shift (task.shift)"
            )
        self._proxy = shared_proxy(task, run, cfg)
        self.proxy: dict[str, Tensor] = get_params(self._proxy)
        self.opt = self.server_optimizer(cfg.server_opt, cfg.aggregator)
        if self.secagg is not None:
            refuse_non_sum(cfg.aggregator)

    def proxy_model(self) -> nn.Module:
        """The proxy instance this process's server and client halves share (scratch)."""
        return self._proxy

    # ----- server half -----
    @override
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        msg = Message("forward", {"proxy": self.proxy})
        fwd_loss = MetricMean("loss")

        def each(cid: str, r: Message) -> None:
            if "loss" in r.meta:  # a DP client sends none
                fwd_loss.add(r)

        got = self.aggregate(
            fed, {c: msg for c in cids}, "proxy", self.proxy, self.opt.round_sum,
            {"proxy": self.proxy}, each,
        )  # fmt: skip
        answered, secure = got.clients, got.metrics
        if got.result is not None:
            self.proxy = self.opt.apply_delta(self.proxy, got.result)
        bwd = fed.broadcast(Message("backward", {"proxy": self.proxy}), answered)
        self.require(fed, bwd, len(answered))
        out: dict[str, float] = {}
        if fwd_loss.count:
            out["forward_loss"] = fwd_loss.mean("loss")
        reported = [r for r in bwd.values() if "loss" in r.meta]
        if reported:
            out["train_loss"] = weighted_mean_metric(reported, "loss")
        out["clients"] = len(bwd)
        out.update(secure)
        gated = {c: r for c, r in bwd.items() if "energy" in r.meta}
        if gated:
            out["energy"] = weighted_mean_metric(gated, "energy")
            out["gate_min"] = min(meta_number(r, "gate_min") for r in gated.values())
            out["gate_max"] = max(meta_number(r, "gate_max") for r in gated.values())
        for key in ("gate_shifted", "gate_kept"):  # over the shifted clients' rows
            vals = [meta_number(r, key) for r in gated.values() if key in r.meta]
            if vals:
                out[key] = sum(vals) / len(vals)
        return out

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        out = summarise_privates(self.task, fed)
        set_params(self._proxy, self.proxy)
        glob = self.task.evaluate(self._proxy, self.task.test_data())
        out.update({f"proxy/{k}": v for k, v in glob.items()})
        return out

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return join_groups({"proxy": self.proxy, "opt": self.opt.state_dict()}), {}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.proxy = get_group(arrays, "proxy")
        self.opt.load_state_dict(get_group(arrays, "opt"))


class LocalPrivateClient(ClientHalf):
    """The client half of the local-only baseline with FedeKD's private architectures."""

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedeKDConfig = _fedekd_config(cfg)
        self.privates = PrivateModels(task, run.seed, self.cfg.private_archs)

    @override
    def handlers(self) -> dict[str, Handler]:
        return {
            "local": self.local,
            "evaluate": lambda ctx, msg: evaluate_privates(self.task, self.privates, ctx, msg),
        }

    def local(self, ctx: ClientContext, msg: Message) -> Message:
        """The private model trained alone (FedeKD's backward stage without the proxy)."""
        private = self.privates.load(ctx)
        res = local_round(
            ctx, private, self.run.train, steps=self.cfg.backward_steps, purpose="backward"
        )
        self.privates.save(ctx, private)
        n = self.task.num_examples(ctx.data)
        return Message("local", meta={"num_examples": n, "loss": res.loss})


class LocalPrivate(Algorithm):
    """Local-only baseline with FedeKD's private architectures: nothing leaves a client.

    Takes FedeKD's config so the same ``algo`` section serves both (the proxy fields are
    unused); the private models train exactly as FedeKD's backward stage with λ = 0.
    """

    Config = FedeKDConfig
    Client = LocalPrivateClient
    messages = (LOCAL, EVALUATE)
    personalised = True

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        replies = fed.broadcast(Message("local"), cids)
        self.require(fed, replies, len(cids))
        return {"train_loss": weighted_mean_metric(replies, "loss"), "clients": len(replies)}

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        return summarise_privates(self.task, fed)


ALGORITHMS.register("fedekd", "FedeKD: private + proxy models, energy-gated backward distillation")(
    FedeKD
)
# The ungated baseline is FedeKD with weight 1 for every sample: a preset, not a subclass.
register_preset(
    "fedkd-ungated",
    "fedekd",
    "private/proxy mutual distillation without gating (FML/FedKD style)",
    fixed={"gate": "ungated"},
)
ALGORITHMS.register(
    "local-private", "local-only baseline with FedeKD's per-client private architectures"
)(LocalPrivate)
