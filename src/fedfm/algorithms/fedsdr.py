"""FedSDR: federated self-distillation with rectification (dual-stream LoRA, selective upload).

Paper: "FedSDR: Federated Self-Distillation with Rectification" (ICML 2026, arXiv 2605.18028);
the rewrite prompt is SDFT's (Yang et al. 2024, sail-sg/sdft). Summary in METHODS.md section 1.

1. **Data refinery (FedSD), round 0**: every client rewrites its answers with the global model
   as teacher (:mod:`fedfm.algorithms.fedsd`, settings ``algo.fedsd``, old name
   ``algo.refinery``); the distilled set ``D_dist`` stays in the client's state and only
   statistics leave the client.
2. **Dual-stream LoRA**: two adapters on the frozen base, both active in every forward pass,
   ``h = W0·h + (α/r)·B_r·A_r·h + (α/r)·B_s·A_s·h``. Local training is block-coordinate:
   stage 1 trains ``LoRA-S`` on ``D_dist`` with ``LoRA-R`` frozen, stage 2 trains ``LoRA-R`` on
   the raw data with ``LoRA-S`` frozen (``algo.steps_s`` and ``algo.steps_r`` steps).
3. **Selective aggregation**: only ``LoRA-R`` leaves the client, in the same ``train`` message
   as FedIT's single adapter (so the uplink bytes are FedIT's), aggregated by
   :func:`fedfm.algorithms.fedavg.fedavg_round` with any server optimizer (FedAvg, FedAvgM,
   FedAdam, FedYogi, FedAdagrad; FedProx is ``algo.prox_mu`` on stage 2). ``LoRA-S`` stays in
   the client's state across rounds, or is reset every round (``algo.reset_s``).
   ``algo.update_cosines`` logs the pairwise cosines of the clients' LoRA-R updates, computed
   by the server from the uploads it aggregates anyway (no extra bytes leave the clients).
   Every round logs ``update_norm``, LoRA-R's drift from its start ‖θ_t − θ_0‖.

The global model, evaluated by the server, is the base with ``LoRA-R`` alone; ``personal_eval``
scores each client's ``LoRA-R + LoRA-S`` on its local test split.

Choices of ours (the paper is silent):

* ``LoRA-R`` starts as FedIT's adapter does (seeded by the run seed); each client's ``LoRA-S``
  is seeded by (run seed, client), and by the round too when reset every round.
* Stage 1 runs before stage 2 in every round, each with a fresh local optimizer (as FedAvg's
  local training) and its own batch order; a stage's steps default to the run's ``train``
  budget.
* The proximal term of FedProx acts on ``LoRA-R`` only (the one adapter the server sees).
* Evaluated items are kept (the run's ``eval_items.jsonl``) so that two runs on the same
  items compare head to head (:mod:`fedfm.eval.compare`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from torch import Tensor
from typing_extensions import override

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.algorithms.fedavg import (
    TRAIN,
    UPDATE_COSINES_HELP,
    evaluate_on_test,
    evaluate_personal,
    fedavg_round,
    train_reply,
)
from fedfm.algorithms.fedsd import REFINE, FedSD, FedSDRequired
from fedfm.config import RunConfig
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.groups import get_group, join_groups
from fedfm.core.messages import EVAL_EXAMPLES, Message, MessageKind
from fedfm.core.optim import ServerOptConfig
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secagg import refuse_non_sum
from fedfm.core.seeding import derive_seed
from fedfm.core.train import TrainResult, client_config, local_train, num_steps, trainable
from fedfm.fm import FoundationModel
from fedfm.tasks.base import HasFoundationModel, Task, TaskConfig, capable

R = "lora_r"  # the rectification stream: trained on raw data, the only one aggregated
S = "lora_s"  # the smoothing stream: trained on the distilled data, never leaves the client
S_GROUP = "lora_s"  # client-state group of LoRA-S

EVALUATE = MessageKind(
    "evaluate",
    down_arrays=("params",),
    up_meta=("num_examples", "metrics"),
    meta_specs={"num_examples": EVAL_EXAMPLES},
)


class FedSDRConfig(FedSDRequired):
    """FedSDR's settings (``algo`` section; FedSD's under ``algo.fedsd``)."""

    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    steps_s: int | None = Field(
        None, ge=1, description="stage-1 steps (LoRA-S on D_dist); None: the train budget"
    )
    steps_r: int | None = Field(
        None, ge=1, description="stage-2 steps (LoRA-R on D_raw); None: the train budget"
    )
    reset_s: bool = Field(False, description="re-initialise LoRA-S every round")
    prox_mu: float = Field(0.0, ge=0, description="FedProx weight on LoRA-R in stage 2")
    personal_eval: bool = False
    update_cosines: bool = Field(False, description=UPDATE_COSINES_HELP)


def train_stage(
    fm: FoundationModel,
    stage: str,
    batches: Any,
    task: Task,
    cfg: Any,
    steps: int,
    prox: bool = False,
) -> TrainResult:
    """One block-coordinate stage: both streams active, only ``stage`` receives gradients.

    Args:
        fm: The foundation model holding both adapters.
        stage: The adapter trained (:data:`S` or :data:`R`); the other is frozen.
        batches: Endless batches of the stage's data.
        task: The task (its loss).
        cfg: Local-training settings (``cfg.prox_mu`` when ``prox``).
        steps: Optimizer steps.
        prox: Pull the trained adapter towards its value at the start of the stage.
    """
    with fm.use([R, S], trainable=[stage]) as model:
        ref = {n: p.detach().clone() for n, p in trainable(model).items()} if prox else None
        return local_train(model, batches, task.loss, cfg, steps, prox_ref=ref)


class FedSDRClient(ClientHalf):
    """FedSDR's client half: FedSD's rewrites, the two stages, personal evaluation.

    Both streams live in the task's foundation model; LoRA-R is loaded from every message,
    LoRA-S from the client's state.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        assert isinstance(cfg, FedSDRConfig), type(cfg)
        self.cfg: FedSDRConfig = cfg
        self.fm = capable(task, HasFoundationModel).foundation_model()
        self.fedsd = FedSD(cfg)
        self._stage_r = run.train.model_copy(update={"prox_mu": cfg.prox_mu})

    @override
    def handlers(self) -> dict[str, Handler]:
        return {"refine": self.refine, "train": self.train, "evaluate": self.evaluate}

    def refine(self, ctx: ClientContext, msg: Message) -> Message:
        """Round 0: the global LoRA-R rewrites the client's answers (see :class:`FedSD`)."""
        with self.fm.slot(R, msg.arrays["params"]):
            return self.fedsd.rewrite(ctx, self.fm, [R], msg.arrays["params"])

    @contextlib.contextmanager
    def _slots(self, ctx: ClientContext, msg: Message, fresh: bool) -> Iterator[None]:
        """LoRA-R from the message and this client's LoRA-S (a seeded init when ``fresh``)."""
        seed = derive_seed(ctx.seed, ctx.cid, "lora_s", ctx.rnd if self.cfg.reset_s else 0)
        s_state = None if fresh else ctx.state.get_group(S_GROUP)
        with self.fm.slot(R, msg.arrays["params"]), self.fm.slot(S, s_state, seed=seed):
            yield

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 1 (LoRA-S on ``D_dist``), stage 2 (LoRA-R on ``D_raw``); uploads LoRA-R."""
        with self._slots(ctx, msg, fresh=self.cfg.reset_s):
            return self._train(ctx, msg)

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        fm, task, cfg = self.fm, self.task, client_config(ctx, self.run.train)
        n = task.num_examples(ctx.data)
        distilled = self.fedsd.data(ctx)
        smooth = task.batches(distilled, cfg.batch_size, ctx.rng_seed("stage-s"))
        train_stage(fm, S, smooth, task, cfg, self.cfg.steps_s or num_steps(cfg, n))
        raw = task.batches(ctx.data, cfg.batch_size, ctx.rng_seed("stage-r"))
        steps_r = self.cfg.steps_r or num_steps(cfg, n)
        res = train_stage(fm, R, raw, task, self._stage_r, steps_r, prox=self.cfg.prox_mu > 0)
        ctx.state.set_group(S_GROUP, fm.get_adapter(S))  # never in a message
        return train_reply(ctx, fm.get_adapter(R), res.loss)

    def evaluate(self, ctx: ClientContext, msg: Message) -> Message:
        """The client's personal model (global LoRA-R + its own LoRA-S) on its local split."""
        data = self.task.client_test_data(ctx.cid)
        fresh = not ctx.state.get_group(S_GROUP)
        with self._slots(ctx, msg, fresh), self.fm.use([R, S]) as model:
            metrics = self.task.evaluate(model, data)
        n = self.task.num_examples(data)
        return Message("evaluate", meta={"num_examples": n, "metrics": metrics})


class FedSDR(Algorithm):
    """FedSDR: FedSD rewrites, dual-stream LoRA, only LoRA-R aggregated (see the module doc)."""

    Config = FedSDRConfig
    Client = FedSDRClient
    messages = (TRAIN, EVALUATE, REFINE)
    update_kinds = ("train",)
    secure_fields: ClassVar[dict[str, str]] = {"train": "params"}  # LoRA-R's weighted sum

    def __init__(self, cfg: FedSDRConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedSDRConfig = cfg
        self.fm = capable(task, HasFoundationModel).foundation_model()
        with self.fm.slot(R, None, seed=run.seed):  # LoRA-R's seeded init
            self.params: dict[str, Tensor] = self.fm.get_adapter(R)
        self.origin = {k: v.clone() for k, v in self.params.items()}  # θ_0 of update_norm
        self.opt = self.server_optimizer(cfg.server_opt, cfg.aggregator)
        self.fedsd = FedSD(cfg)
        if self.secagg is not None:
            refuse_non_sum(cfg.aggregator, cfg.update_cosines)

    @classmethod
    @override
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        FedSD.check_task(cfg, task_cls, task_cfg, "task.kind")

    # ----- server half -----
    @override
    def setup(self, fed: Federation) -> dict[str, float]:
        return self.fedsd.setup(self, fed, self.params)

    @override
    def secure_base(self) -> dict[str, Tensor]:
        return self.params

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        self.params, metrics = fedavg_round(
            self, fed, self.params, self.opt, self.cfg.update_cosines, self.origin
        )
        return metrics

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        """The global model (base + LoRA-R) on the test set; personal models when asked."""
        with self.fm.slot(R, self.params), self.fm.use([R]) as model:
            out = evaluate_on_test(self.task, model)
        if self.cfg.personal_eval:
            out.update(evaluate_personal(fed, self.params))
        return out

    @override
    def export_adapter(self, folder: Path) -> bool:
        """The global model is the base with LoRA-R (LoRA-S never leaves its client)."""
        with self.fm.slot(R, self.params):
            self.fm.save_adapter(R, folder)
        return True

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return join_groups({"params": self.params, "opt": self.opt.state_dict()}), {}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, "params")
        self.opt.load_state_dict(get_group(arrays, "opt"))


ALGORITHMS.register("fedsdr", "FedSDR: FedSD rewrites + dual-stream LoRA, only LoRA-R aggregated")(
    FedSDR
)
