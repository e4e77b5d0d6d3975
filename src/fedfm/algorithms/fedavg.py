"""The FedAvg family: FedAvg with any server optimizer, FedProx, SCAFFOLD, and local-only.

Papers:
- FedAvg: McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data".
- FedAvgM, FedAdagrad, FedAdam, FedYogi: Reddi et al. 2021, "Adaptive Federated
  Optimization" (server optimizers in :mod:`fedfm.core.optim`).
- FedProx: Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (the proximal
  term lives in :func:`fedfm.core.train.local_train`).
- SCAFFOLD: Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
  Federated Learning" (option II control variates).
- FedIT (Zhang et al. 2024) is FedAvg over LoRA adapters: the same code on an LM task,
  where the task's model exposes only adapter tensors as trainable.

Choices of ours: aggregation weights are the clients' training-set sizes; parameters and
floating-point buffers (e.g. BatchNorm statistics) are averaged alike; the local-only
baseline trains each client's own model for the same local budget per round.
``algo.aggregator`` replaces the weighted mean by a robust rule (clipping, median, trimmed
mean, Krum; :mod:`fedfm.core.robust`) before the server optimizer; default: the mean.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from torch import Tensor, nn

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.messages import EVAL_EXAMPLES, Message, MessageKind
from fedfm.core.optim import ServerOptConfig, ServerOptimizer, scaffold_client_control
from fedfm.core.optim import scaffold_server_update as scaffold_update
from fedfm.core.robust import AggregatorConfig
from fedfm.core.train import get_params, local_train, num_steps, set_params

TRAIN = MessageKind(
    "train", down_arrays=("params",), up_arrays=("params",), up_meta=("num_examples", "loss")
)
EVALUATE = MessageKind(
    "evaluate",
    down_arrays=("params",),
    up_meta=("num_examples", "metrics"),
    meta_specs={"num_examples": EVAL_EXAMPLES},  # a local test split may be empty
)


class FedAvgConfig(AlgoConfig):
    """FedAvg with a choice of server optimizer and of (robust) aggregation."""

    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    personal_eval: bool = Field(
        False, description="also evaluate the global model on each client's local test split"
    )


def weighted_mean_metric(replies: dict[str, Message], key: str) -> float:
    """Example-weighted mean of a numeric meta field over replies."""
    n = sum(float(r.meta["num_examples"]) for r in replies.values())
    return sum(float(r.meta[key]) * float(r.meta["num_examples"]) for r in replies.values()) / n


def summarise_client_metrics(
    per_client: dict[str, dict[str, float]], prefix: str
) -> dict[str, float]:
    """Mean and worst client of each metric (worst = min, or max for losses and errors)."""
    out: dict[str, float] = {}
    names = sorted({k for m in per_client.values() for k in m})
    for name in names:
        vals = [m[name] for m in per_client.values() if name in m]
        lower_better = name.rsplit("/", 1)[-1] in ("loss", "rmse")
        worst = max(vals) if lower_better else min(vals)
        out[f"{prefix}{name}"] = sum(vals) / len(vals)
        out[f"{prefix}{name}/worst"] = worst
    return out


class FedAvg(Algorithm):
    """FedAvg over a task's trainable tensors, with any server optimizer (Reddi et al. 2021)."""

    Config = FedAvgConfig
    messages = (TRAIN, EVALUATE)

    def __init__(self, cfg: FedAvgConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedAvgConfig = cfg
        self._model: nn.Module | None = None
        self.params: dict[str, Tensor] = get_params(self.model())
        self.opt = ServerOptimizer(cfg.server_opt, cfg.aggregator)

    def model(self) -> nn.Module:
        """A model instance reused by this process's server and client halves."""
        if self._model is None:
            self._model = self.task.build_model(seed=self.run.seed)
        return self._model

    # ----- client half -----
    def handlers(self) -> dict[str, Handler]:
        return {"train": self.client_train, "evaluate": self.client_evaluate}

    def local_round(self, ctx: ClientContext, model: nn.Module, **kw: Any) -> Any:
        """Trains ``model`` on the client's data with the run's local-training settings."""
        data = ctx.data
        steps = num_steps(self.run.train, self.task.num_examples(data))
        batches = self.task.batches(data, self.run.train.batch_size, ctx.rng_seed("batches"))
        return local_train(model, batches, self.task.loss, self.train_cfg(), steps, **kw)

    def train_cfg(self) -> Any:
        """Local-training settings (FedProx overrides the proximal weight)."""
        return self.run.train

    def client_train(self, ctx: ClientContext, msg: Message) -> Message:
        model = self.model()
        glob = msg.arrays["params"]
        set_params(model, glob)
        res = self.local_round(ctx, model, prox_ref=glob)
        n = self.task.num_examples(ctx.data)
        return Message(
            "train",
            {"params": get_params(model, list(glob))},
            {"num_examples": n, "loss": res.loss},
        )

    def client_evaluate(self, ctx: ClientContext, msg: Message) -> Message:
        model = self.model()
        set_params(model, msg.arrays["params"])
        data = self.task.client_test_data(ctx.cid)
        metrics = self.task.evaluate(model, data)
        return Message(
            "evaluate", meta={"num_examples": self.task.num_examples(data), "metrics": metrics}
        )

    # ----- server half -----
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        msg = Message("train", {"params": self.params})
        replies = fed.broadcast(msg, cids, like={"params": self.params})
        self.require(fed, replies, len(cids))
        updates = [r.arrays["params"] for r in replies.values()]
        weights = [float(r.meta["num_examples"]) for r in replies.values()]
        self.params = self.opt.step(self.params, updates, weights)
        return {"train_loss": weighted_mean_metric(replies, "loss"), "clients": len(replies)}

    def evaluate(self, fed: Federation) -> dict[str, float]:
        model = self.model()
        set_params(model, self.params)
        out = self.task.evaluate(model, self.task.test_data())
        if self.cfg.personal_eval:
            replies = fed.broadcast(Message("evaluate", {"params": self.params}), fed.client_ids())
            per = {
                c: {f"local/{k}": v for k, v in r.meta["metrics"].items()}
                for c, r in replies.items()
            }
            out.update(summarise_client_metrics(per, ""))
            out["per_client"] = per
        return out

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        arrays = {f"params/{k}": v for k, v in self.params.items()}
        arrays.update({f"opt/{k}": v for k, v in self.opt.state_dict().items()})
        return arrays, {}

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = {k[7:]: v for k, v in arrays.items() if k.startswith("params/")}
        self.opt.load_state_dict({k[4:]: v for k, v in arrays.items() if k.startswith("opt/")})


class FedProxConfig(FedAvgConfig):
    """FedProx: FedAvg plus a proximal term of weight ``mu`` in local training."""

    mu: float = Field(0.01, ge=0)


class FedProx(FedAvg):
    """FedProx (Li et al. 2020): local loss + (mu/2)·||w − w_global||²."""

    Config = FedProxConfig

    def train_cfg(self) -> Any:
        return self.run.train.model_copy(update={"prox_mu": self.cfg.mu})  # type: ignore[attr-defined]


SCAFFOLD_TRAIN = MessageKind(
    "train",
    down_arrays=("params", "control"),
    up_arrays=("delta_y", "delta_c"),
    up_meta=("num_examples", "loss"),
)


class ScaffoldConfig(AlgoConfig):
    """SCAFFOLD with a global step size."""

    lr_global: float = Field(1.0, gt=0)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    personal_eval: bool = False


class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al. 2020), option II control variates.

    Clients keep their control variate ``c_i`` in their persistent state; local steps use
    SGD with the gradient corrected by ``c − c_i``.
    """

    Config = ScaffoldConfig  # type: ignore[assignment]
    messages = (SCAFFOLD_TRAIN, EVALUATE)

    def __init__(self, cfg: ScaffoldConfig, task: Any, run: Any) -> None:
        super().__init__(FedAvgConfig(personal_eval=cfg.personal_eval), task, run)
        self.cfg = cfg  # type: ignore[assignment]
        self.control = {k: v.zero_() for k, v in get_params(self.model()).items()}

    def client_train(self, ctx: ClientContext, msg: Message) -> Message:
        model = self.model()
        glob, c = msg.arrays["params"], msg.arrays["control"]
        c_i = ctx.state.get_group("control") or {k: v.new_zeros(v.shape) for k, v in c.items()}
        set_params(model, glob)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        corr = {n: c[n] - c_i[n] for n in names}
        res = self.local_round(ctx, model, grad_correction=corr)
        local = get_params(model, list(glob))
        c_new = scaffold_client_control(c_i, c, glob, local, res.steps, self.run.train.lr)
        ctx.state.set_group("control", c_new)
        n = self.task.num_examples(ctx.data)
        return Message(
            "train",
            {
                "delta_y": {k: local[k] - glob[k] for k in glob},
                "delta_c": {k: c_new[k] - c_i[k] for k in c},
            },
            {"num_examples": n, "loss": res.loss},
        )

    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        msg = Message("train", {"params": self.params, "control": self.control})
        replies = fed.broadcast(msg, cids, like={"delta_y": self.params, "delta_c": self.control})
        self.require(fed, replies, len(cids))
        rs = list(replies.values())
        self.params, self.control = scaffold_update(
            self.params,
            self.control,
            [r.arrays["delta_y"] for r in rs],
            [r.arrays["delta_c"] for r in rs],
            [float(r.meta["num_examples"]) for r in rs],
            len(fed.client_ids()),
            self.cfg.lr_global,
            self.cfg.aggregator,
        )
        return {"train_loss": weighted_mean_metric(replies, "loss"), "clients": len(replies)}

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        arrays, meta = super().state_dict()
        arrays.update({f"control/{k}": v for k, v in self.control.items()})
        return arrays, meta

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        super().load_state_dict(arrays, meta)
        self.control = {k[8:]: v for k, v in arrays.items() if k.startswith("control/")}


LOCAL_TRAIN = MessageKind("train", up_meta=("num_examples", "loss"))
LOCAL_EVALUATE = MessageKind(
    "evaluate", up_meta=("num_examples", "metrics"), meta_specs={"num_examples": EVAL_EXAMPLES}
)


class LocalOnly(FedAvg):
    """Local-only baseline: each client trains its own model and shares nothing.

    Each client's model lives in its persistent state; evaluation reports each client's model
    on the global test set (``test/``) and on its own local test split (``local/``).
    """

    Config = AlgoConfig  # type: ignore[assignment]
    messages = (LOCAL_TRAIN, LOCAL_EVALUATE)
    personalised = True

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(FedAvgConfig(), task, run)

    def _load_own(self, ctx: ClientContext) -> nn.Module:
        model = self.model()
        own = ctx.state.get_group("model")
        set_params(model, own or self.params)  # every client starts from the same init
        return model

    def client_train(self, ctx: ClientContext, msg: Message) -> Message:
        model = self._load_own(ctx)
        res = self.local_round(ctx, model)
        ctx.state.set_group("model", get_params(model))
        return Message(
            "train", meta={"num_examples": self.task.num_examples(ctx.data), "loss": res.loss}
        )

    def client_evaluate(self, ctx: ClientContext, msg: Message) -> Message:
        model = self._load_own(ctx)
        glob = {f"test/{k}": v for k, v in self.task.evaluate(model, self.task.test_data()).items()}
        loc = self.task.evaluate(model, self.task.client_test_data(ctx.cid))
        metrics = {**glob, **{f"local/{k}": v for k, v in loc.items()}}
        return Message(
            "evaluate", meta={"num_examples": self.task.num_examples(ctx.data), "metrics": metrics}
        )

    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        replies = fed.broadcast(Message("train"), cids)
        self.require(fed, replies, len(cids))
        return {"train_loss": weighted_mean_metric(replies, "loss"), "clients": len(replies)}

    def evaluate(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("evaluate"), fed.client_ids())
        per = {c: r.meta["metrics"] for c, r in replies.items()}
        out = summarise_client_metrics(per, "")
        # The headline metric of a local-only run is the mean client on the global test set.
        primary = self.task.primary
        if f"test/{primary}" in out:
            out[primary] = out[f"test/{primary}"]
        out["per_client"] = per
        return out

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return {}, {}

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        pass


ALGORITHMS.register("fedavg", "FedAvg with any server optimizer (fedavg, fedavgm, fedadam, ...)")(
    FedAvg
)
ALGORITHMS.register("fedprox", "FedProx: FedAvg with a proximal term in local training")(FedProx)
ALGORITHMS.register("scaffold", "SCAFFOLD: control variates against client drift")(Scaffold)
ALGORITHMS.register("local", "local-only baseline: every client trains alone")(LocalOnly)
