"""Resource-adaptive federated DP text generation: strong clients fine-tune, weak clients vote.

Paper: "Resource-Adaptive Federated Text Generation with Differential Privacy" (ICLR 2026,
arXiv:2603.07027; no public code). Cross-silo clients hold labelled or tagged text; a control
code (label, topic, rating) is public metadata. Only *strong* clients can fine-tune the LLM;
*weak* clients never backpropagate and speak once. Four stages, each an engine step (so a run
resumes between any two of them; ``R = algo.train_rounds``):

* **round 0, DP profiling** (every client, ``profile``): the client's per-code count vector
  plus Gaussian noise calibrated by the analytic Gaussian mechanism (Balle & Wang 2018,
  dp-accounting) for ``(epsilon_profile, δ)``, L2 sensitivity 1 (one record changes one count
  by 1). The server sums the vectors and clips negatives: ``P̃``.
* **rounds 1..R, DP federated fine-tuning** (strong clients, ``train``): LoRA on the causal LM
  with the loss of "code → text" (the code in the prompt, the text the response), DP-SGD
  through Opacus (:meth:`fedfm.fm.FoundationModel.dp_train`: Poisson sampling, per-sample
  clipping, Gaussian noise); the noise multiplier is calibrated from ``(epsilon_train, δ)``
  for the planned ``R · train.steps`` steps at the client's sampling rate.
  ``epsilon_train: inf`` trains without noise or clipping. Any server optimizer
  (``algo.server_opt``) and aggregator aggregate the adapters. ``finetune: full`` trains
  every weight of the causal LM instead (the paper's main setting, for a small model):
  the ``train`` messages carry all weights (``weights``) and the server aggregates them; the
  DP-SGD mechanism, so the ledger, is the same (σ, rate and steps do not depend on which
  tensors are trained).
* **round R+1, generation** (server): ``s_j = round(s · P̃[j] / Σ P̃)`` samples of code ``j``
  from the fine-tuned model, batched and seeded, with the config's temperature and top-p.
* **round R+2, DP voting** (weak clients, ``vote``, gradient-free): each private sample,
  embedded with MiniLM, votes for its ``K`` nearest synthetic samples *of the same code*, each
  vote worth ``1/√K`` so that one sample's contribution has L2 norm 1 (Private Evolution, Lin
  et al. 2024); the histogram gets analytic-Gaussian noise for ``(epsilon_vote, δ)``. The
  server sums, clips (``max(h − H, 0)``, PrE-Text's threshold, ``H = vote_threshold``) and
  resamples the synthetic set in proportion to the clipped votes (``selection: resample``) or
  keeps the top share (``selection: rank``, Aug-PE's alternative).

Only noised counts, noised votes and post-DP-SGD adapters leave clients: every message kind
is declared private (:class:`~fedfm.core.messages.MessageKind`), so a reply with any other
field is refused and the audit ledger marks each field a DP output. Every noise draw comes
from the client's own secret (:mod:`fedfm.core.secret`) unless ``privacy.noise: seeded``.
Every mechanism is registered per client in the privacy ledger: strong clients compose DP-SGD
and profiling, weak clients profiling and voting (``privacy.json``); the server registers a
strong client's DP-SGD from its plan (σ, the rate ``q = train.batch_size / n`` of the
config's partition, ``train.steps``) when it asks the client, and the client keeps its own
account in its state.
The synthetic set before and after voting is a run artefact (``synthetic_initial.jsonl``,
``synthetic.jsonl``: ``code``, ``label``, ``text``, and ``truncated``: whether the sample ran
into ``max_new_tokens``; the generation round logs their share), and ``heldout.json`` names the real
held-out rows, so the ``synthetic`` text source (:mod:`fedfm.data.synthetic`) serves it to any
downstream ``fedfm run``. After generation and after voting the set is evaluated
(:mod:`fedfm.eval.synthetic`): classifiers trained on it alone, tested on the real held-out set.

Choices of ours (the paper is silent; where a choice is a value, it is a config option):
    * Profiling runs first (round 0) rather than after fine-tuning: it does not depend on the
      model, and the order of independent mechanisms does not change their composition.
    * Clients without the ``strong`` role are weak (named ``weak`` or left ``default``);
      only weak clients vote, each once; strong clients do not vote.
    * Strong clients' adapters are averaged with equal weights: a client's row count is not
      sent, so the weights are public.
    * Each mechanism is calibrated at the same δ (``algo.delta``, default ``privacy.delta``);
      the ledger reports their composition at that δ with its accountant.
    * Resampling draws, with replacement, as many samples per code as the code was allotted
      (``resample_scope: code``), so the DP profile keeps fixing the code mix; ``all`` draws
      over the whole set in proportion to its votes. A code whose clipped votes are all zero
      keeps a uniform draw of its samples (logged). ``resample_size`` defaults to ``s``.
    * ``P̃`` that sums to 0 allots uniformly; ``round`` (half to even, Python's) may make
      ``Σ s_j`` differ from ``s``.
    * A code with fewer than ``K`` synthetic samples gets one vote of ``1/√K`` for each of them
      (norm below 1); a client without samples of a code votes nothing for it.
    * The prompt of code ``c`` is ``prompt_template`` with ``{code}`` filled in, in the LM's
      chat template (the same in training and generation); texts are the responses.
    * Planned DP-SGD steps assume a strong client takes part in every training round (an upper
      bound on what it spends under client sampling).
    * DP-SGD uses ``train.batch_size`` as the expected Poisson batch and ``train.steps`` steps
      per round; ``train.epochs`` is refused (steps are what is accounted).
    * "Nearest" is the largest cosine similarity of L2-normalised embeddings (ties to the lower
      index); votes are float64 sums.
    * Full fine-tuning clips each sample's gradient over all weights jointly (one norm
      ``max_grad_norm``, as for LoRA); tied input and output embeddings are one tensor, its
      per-sample gradient the sum of both uses (Opacus). The shared base gets its
      pretrained weights back after every call, so other runs of the process are unaffected.
    * Each training round logs ``update_norm``, ``‖θ_r − θ_0‖₂`` of the LoRA adapter (how far
      DP-SGD has moved it from its initialisation).
    * Each round's row times its stages (``time/generate_s``, ``time/eval_s``,
      ``time/eval_real_s``, ``time/floor_s``, ``time/vote_clients_s``), and the evaluated
      rows keep each classifier's prediction per held-out row (``eval_items.jsonl``) so that
      two sets can be compared paired over the same test rows.
    * Defaults: ``epsilon_profile = epsilon_vote = 1``, ``K = 4``, ``s = 200``, sampling at
      temperature 1 and top-p 0.9 for 48 new tokens, ``H = 0``, resampling (not ranking).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor
from typing_extensions import override

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.algorithms.dpsyn_eval import SyntheticScorer
from fedfm.algorithms.dpsyn_mechanisms import (
    allot,
    clip_votes,
    code_counts,
    knn_votes,
    noisy,
    select,
)
from fedfm.algorithms.lora_clients import lora_spec
from fedfm.config import RunConfig
from fedfm.core.aggregate import equal_weight
from fedfm.core.federation import ClientContext, Federation, Handler, assign_roles
from fedfm.core.groups import get_group, join_groups
from fedfm.core.lora_ranks import A_SUFFIX
from fedfm.core.messages import Message, MessageKind
from fedfm.core.optim import ServerOptConfig, ServerOptimizer
from fedfm.core.privacy import analytic_gaussian_sigma
from fedfm.core.robust import AggregatorConfig, update_norms
from fedfm.core.secret import noise_seed
from fedfm.core.seeding import derive_seed
from fedfm.core.stages import Stage
from fedfm.data.synthetic import HELDOUT
from fedfm.errors import ConfigError
from fedfm.eval.synthetic import SyntheticEvalConfig
from fedfm.fm import Adapters, FullWeights
from fedfm.models.encoders import known_encoder, text_embedder
from fedfm.models.generation import GenerationConfig
from fedfm.tasks.base import (
    CONTROL_CODES,
    FOUNDATION_MODEL,
    TEXT_VIEW,
    ControlCodes,
    HasFoundationModel,
    Task,
    TaskConfig,
    TextView,
    capable,
    require,
)

if TYPE_CHECKING:
    from fedfm.core.dp import DPSGDConfig

log = logging.getLogger("fedfm")

STRONG = "strong"
WEAK_ROLES = ("weak", "default")
ADAPTER = "dpsyn"

# Every client is a DP client: each reply carries only a mechanism's output (no loss, no
# row count, no sampling rate that would reveal it).
TRAIN = MessageKind(
    "train",
    down_arrays=("adapter", "weights"),  # one of them: LoRA or (finetune: full) every weight
    up_arrays=("adapter", "weights"),
    roles=(STRONG,),
    dp_fields=("adapter", "weights"),
    dp=True,
    private=True,
)
PROFILE = MessageKind(
    "profile", up_arrays=("counts",), no_grad=True, dp_fields=("counts",), dp=True, private=True
)
VOTE = MessageKind(
    "vote",
    down_meta=("texts", "codes"),
    up_arrays=("votes",),
    roles=WEAK_ROLES,
    no_grad=True,
    dp_fields=("votes",),
    dp=True,
    private=True,
)


class DPSynConfig(AlgoConfig):
    """DP federated text generation (see the module doc for every stage).

    Attributes:
        train_rounds: Fine-tuning rounds ``R`` (0: generate with the base model). The run's
            ``rounds`` is at most ``R + 2`` (its stages, :meth:`DPSyn.stages`), ``R + 2`` when
            the config does not give it; fewer stop after that stage (resume to go on).
        finetune: ``lora``: DP-SGD on a LoRA adapter (``task.lora``); ``full``: on every
            weight of the causal LM (the paper's main setting), which the messages then
            carry in full (``weights``) and the server aggregates.
        epsilon_train: ε of each strong client's DP-SGD; ``inf``: no noise, no clipping.
        epsilon_profile: ε of each client's noisy count vector.
        epsilon_vote: ε of each weak client's noisy vote histogram.
        delta: δ of every mechanism; ``None`` takes ``privacy.delta``.
        max_grad_norm: DP-SGD per-sample clipping norm.
        physical_batch_size: Rows per forward/backward pass within one Poisson batch.
        server_opt: Server optimizer of the adapters.
        aggregator: Aggregation rule of the adapters.
        prompt_template: The prompt of a code (``{code}`` is replaced by its name).
        num_samples: ``s``, synthetic samples to generate.
        generation: Decoding (sampling on, temperature, top-p, length, batch size).
        embedder: Sentence embedder of the votes (``all-minilm-l6-v2``).
        k: ``K``, synthetic samples each private sample votes for.
        vote_threshold: ``H`` subtracted from the summed noisy votes before clipping at 0.
        selection: ``resample`` (in proportion to votes) or ``rank`` (keep the top share).
        keep_fraction: Share of each code's samples that ``rank`` keeps.
        resample_scope: Resample within each code (its allotment) or over the whole set.
        resample_size: Samples after resampling (``None``: ``num_samples``).
        eval: Downstream evaluation of the synthetic set, in the rows of rounds ``R + 1``
            (generated) and ``R + 2`` (voted) when the engine evaluates them (``eval_every``
            of 1, the default, evaluates both).
    """

    train_rounds: int = Field(3, ge=0)
    finetune: Literal["lora", "full"] = "lora"
    epsilon_train: float | Literal["inf"] = 8.0
    epsilon_profile: float = Field(1.0, gt=0)
    epsilon_vote: float = Field(1.0, gt=0)
    delta: float | None = Field(None, gt=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    physical_batch_size: int = Field(8, ge=1)
    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    prompt_template: str = "Write a {code} review."
    num_samples: int = Field(200, ge=1)
    generation: GenerationConfig = Field(
        default_factory=lambda: GenerationConfig(
            do_sample=True, temperature=1.0, top_p=0.9, max_new_tokens=48, batch_size=16
        )
    )
    embedder: str = "all-minilm-l6-v2"
    k: int = Field(4, ge=1)
    vote_threshold: float = Field(0.0, ge=0)
    selection: Literal["resample", "rank"] = "resample"
    keep_fraction: float = Field(0.5, gt=0, le=1)
    resample_scope: Literal["code", "all"] = "code"
    resample_size: int | None = Field(None, ge=1)
    eval: SyntheticEvalConfig = Field(default_factory=SyntheticEvalConfig)

    @field_validator("epsilon_train")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if isinstance(v, float) and not v > 0:
            raise ValueError("must be greater than 0 (or inf: no noise, no clipping)")
        return v

    @field_validator("prompt_template")
    @classmethod
    def _has_code(cls, v: str) -> str:
        if "{code}" not in v:
            raise ValueError("must contain '{code}'")
        return v

    @field_validator("embedder")
    @classmethod
    def _known_embedder(cls, v: str) -> str:
        return known_encoder(v, "texts", unit_norm=True)

    @property
    def train_epsilon(self) -> float:
        """``epsilon_train`` as a number (``math.inf`` for ``inf``)."""
        return math.inf if self.epsilon_train == "inf" else float(self.epsilon_train)


# ----------------------------------------------------------------------------- the algorithm


def dp_delta(cfg: DPSynConfig, run: RunConfig) -> float:
    """The δ of every dpsyn mechanism: ``algo.delta``, else the run's ``privacy.delta``."""
    return cfg.delta if cfg.delta is not None else run.privacy.delta


def planned_steps(cfg: DPSynConfig, run: RunConfig) -> int:
    """DP-SGD steps a strong client takes over the run (what its noise is calibrated for)."""
    return cfg.train_rounds * run.train.steps


def dp_sgd_settings(cfg: DPSynConfig, run: RunConfig) -> DPSGDConfig:
    """DP-SGD settings of every strong client, its noise multiplier not yet calibrated."""
    from fedfm.core.dp import DPSGDConfig  # Opacus only for runs that use DP-SGD

    return DPSGDConfig(
        epsilon=cfg.train_epsilon,
        delta=dp_delta(cfg, run),
        max_grad_norm=cfg.max_grad_norm,
        noise_multiplier=None,
        physical_batch_size=cfg.physical_batch_size,
    )


def dp_sgd_config(cfg: DPSynConfig, run: RunConfig, rate: float) -> DPSGDConfig:
    """DP-SGD settings of a client sampled at ``rate``, its noise multiplier calibrated."""
    from fedfm.core.dp import calibrate_noise  # Opacus only for runs that use DP-SGD

    dp = dp_sgd_settings(cfg, run)
    if not math.isfinite(dp.epsilon):
        return dp
    sigma = calibrate_noise(dp.epsilon, dp_delta(cfg, run), rate, planned_steps(cfg, run))
    return dp.model_copy(update={"noise_multiplier": sigma})


def ffa_lora(task: Task) -> bool:
    """FFA-LoRA is on (``task.lora.freeze_a``): DP-SGD trains and sends ``B`` only."""
    spec = lora_spec(task)
    return spec is not None and spec.freeze_a


def a_of(adapter: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The ``A`` factors of an adapter state."""
    return {k: v.clone() for k, v in adapter.items() if k.endswith(A_SUFFIX)}


class DPSynClient(ClientHalf):
    """dpsyn's client half: DP profiling (every client), DP-SGD (strong), DP votes (weak).

    Every reply is a mechanism's output; its noise comes from the client's own secret.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        assert isinstance(cfg, DPSynConfig), type(cfg)
        self.cfg: DPSynConfig = cfg
        self.codes = capable(task, ControlCodes).codes()
        self.fm = capable(task, HasFoundationModel).foundation_model()
        self.full = cfg.finetune == "full"
        self.frozen_a: dict[str, Tensor] = {}  # FFA-LoRA's A, drawn from the run seed
        if not self.full and ffa_lora(task):  # the A the server's adapter started from
            with self.fm.slot(ADAPTER, None, seed=derive_seed(run.seed, "adapter")):
                self.frozen_a = a_of(self.fm.get_adapter(ADAPTER))
        self.delta = dp_delta(cfg, run)
        self.sigma_profile = analytic_gaussian_sigma(cfg.epsilon_profile, self.delta)
        self.sigma_vote = analytic_gaussian_sigma(cfg.epsilon_vote, self.delta)
        self._rows: dict[str, list[dict[str, list[int]]]] = {}  # encoded rows per client

    @override
    def handlers(self) -> dict[str, Handler]:
        return {"profile": self.profile, "train": self.train, "vote": self.vote}

    def rows(self, cid: str, data: Any) -> list[dict[str, list[int]]]:
        """Client ``cid``'s "code → text" rows, tokenised once per process."""
        if cid not in self._rows:
            codes = capable(self.task, ControlCodes).code_ids(data).tolist()
            texts = capable(self.task, TextView).texts(data)
            self._rows[cid] = self.fm.encode(
                {"instruction": self.cfg.prompt_template.format(code=self.codes[j]), "output": t}
                for j, t in zip(codes, texts, strict=True)
            )
        return self._rows[cid]

    def noise_seed(self, ctx: ClientContext, purpose: str) -> int:
        """A noise seed from the client's secret (``seeded``: from the run seed)."""
        return noise_seed(ctx, purpose, self.run.privacy.noise)

    def profile(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 2: this client's per-code counts plus analytic-Gaussian noise."""
        counts = code_counts(capable(self.task, ControlCodes).code_ids(ctx.data), len(self.codes))
        out = noisy(counts, self.sigma_profile, self.noise_seed(ctx, "profile-noise"))
        return Message("profile", {"counts": {"counts": out}})

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 1: DP-SGD on the received adapter (or weights) over "code → text" rows."""
        from fedfm.core.dp import sample_rate
        from fedfm.core.train import client_config

        rows = self.rows(ctx.cid, ctx.data)
        rate = sample_rate(self.run.train.batch_size, len(rows))
        kw: dict[str, Any] = {
            "train": client_config(ctx, self.run.train),  # the round's scheduled lr
            "dp": dp_sgd_config(self.cfg, self.run, rate),
            "delta": self.delta,
            "steps": self.run.train.steps,
            "planned_steps": planned_steps(self.cfg, self.run),
            "seed": self.noise_seed(ctx, "dp"),
            "field": "algo",
        }
        what: Adapters | FullWeights = Adapters([ADAPTER], [ADAPTER], frozenset(self.frozen_a))
        slot: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.full:
            what = FullWeights(msg.arrays["weights"])
        else:
            slot = self.fm.slot(ADAPTER, {**self.frozen_a, **msg.arrays["adapter"]})
        with slot:
            _, out = self.fm.dp_train(rows, ctx.state, what, **kw)
        out = {k: v for k, v in out.items() if k not in self.frozen_a}  # FFA-LoRA: B only
        # The client's own account stays in its state; the server accounts from its plan.
        return Message("train", {"weights" if self.full else "adapter": out})

    def vote(self, ctx: ClientContext, msg: Message) -> Message:
        """Stage 4: K-NN votes of the private samples within their code, plus noise."""
        texts, codes = msg.meta["texts"], msg.meta["codes"]
        assert isinstance(texts, list) and isinstance(codes, list)
        embed = text_embedder(self.cfg.embedder, self.task.device)
        votes = knn_votes(
            embed(capable(self.task, TextView).texts(ctx.data)),
            capable(self.task, ControlCodes).code_ids(ctx.data).numpy(),
            embed([str(t) for t in texts]),
            np.asarray(codes, dtype=np.int64),
            self.cfg.k,
        )
        out = noisy(torch.as_tensor(votes), self.sigma_vote, self.noise_seed(ctx, "vote-noise"))
        return Message("vote", {"votes": {"votes": out}})


class DPSyn(Algorithm):
    """Strong clients DP-fine-tune, every client DP-profiles, weak clients DP-vote."""

    Config = DPSynConfig
    Client = DPSynClient
    messages = (PROFILE, TRAIN, VOTE)
    lora_options = ("freeze_a",)

    @classmethod
    @override
    def stages(cls, cfg: AlgoConfig) -> tuple[Stage, ...]:
        """DP fine-tuning for ``algo.train_rounds`` rounds, then generation, then voting."""
        assert isinstance(cfg, DPSynConfig), type(cfg)
        return (Stage("train", cfg.train_rounds), Stage("generate", 1), Stage("vote", 1))

    @classmethod
    @override
    def stages_origin(cls) -> str:
        return "train: algo.train_rounds"

    @override
    @classmethod
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        for cap in (CONTROL_CODES, FOUNDATION_MODEL, TEXT_VIEW):
            require(task_cls, task_cfg, cap, "algorithm", "dpsyn")

    def __init__(self, cfg: DPSynConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: DPSynConfig = cfg
        self.codes = capable(task, ControlCodes).codes()
        self.fm = capable(task, HasFoundationModel).foundation_model()
        self.full = cfg.finetune == "full"
        self.field = "weights" if self.full else "adapter"  # the message and state group
        if self.full:  # the pretrained weights (full_weights leaves the shared base as it was)
            self.params = self.fm.get_weights()
        else:
            with self.fm.slot(ADAPTER, None, seed=derive_seed(run.seed, "adapter")):
                self.params = self.fm.get_adapter(ADAPTER)
        # FFA-LoRA (task.lora.freeze_a): A stays as drawn; only B travels and is averaged.
        self.frozen_a = a_of(self.params) if not self.full and ffa_lora(task) else {}
        self.params = {k: v for k, v in self.params.items() if k not in self.frozen_a}
        # θ_0, for the update norm ‖θ_r − θ_0‖ each training round logs (LoRA only: a copy of
        # every weight would double a full fine-tuning's memory).
        self.start = None if self.full else dict(self.params)
        self.opt = ServerOptimizer(cfg.server_opt, cfg.aggregator)
        self.delta = dp_delta(cfg, run)
        self.planned = planned_steps(cfg, run)
        self.plan: dict[str, tuple[float, float]] = {}  # strong client -> (σ, q) of its DP-SGD
        self._check_plan(task, run)
        self._check_prompts()
        self.sigma_profile = analytic_gaussian_sigma(cfg.epsilon_profile, self.delta)
        self.sigma_vote = analytic_gaussian_sigma(cfg.epsilon_vote, self.delta)
        self.profile: Tensor | None = None
        self.synthetic: list[dict[str, Any]] = []
        self.final: list[dict[str, Any]] = []
        self.scorer = SyntheticScorer(task, cfg.eval, cfg.embedder, run.seed)

    def _check_plan(self, task: Task, run: RunConfig) -> None:
        """Refuses, at config load, a plan no client can carry out (naming the field)."""
        from fedfm.core.dp import check_delta, plan_dp_sgd, sample_rate  # Opacus: runs using it

        if run.train.epochs is not None:
            raise ConfigError("train.epochs", "dpsyn accounts DP-SGD steps: set train.steps")
        roles = {
            c.cid: c.role for c in assign_roles(task.client_ids(), run.clients.roles, run.seed)
        }
        self.strong = [c for c, r in roles.items() if r == STRONG]
        if not self.strong:
            raise ConfigError(
                "clients.roles",
                f"no strong client among {len(roles)} (set e.g. clients.roles.strong: 0.2 or a "
                "list of client ids)",
            )
        field = "algo.delta" if self.cfg.delta is not None else "privacy.delta"
        for cid in task.client_ids():
            n = task.num_examples(task.client_data(cid))
            if n < 1:
                raise ConfigError("partition", f"client {cid} holds no rows")
            try:
                check_delta(self.delta, n, field)
            except ConfigError as err:
                raise ConfigError(err.field, f"client {cid}: {err.reason}") from None
        if self.planned < 1:
            return
        sizes = {c: len(task.client_data(c)) for c in self.strong}
        by_rate = sorted(sizes, key=lambda c: sample_rate(run.train.batch_size, sizes[c]))
        sigmas = plan_dp_sgd(
            dp_sgd_settings(self.cfg, run),
            self.delta,
            {c: sizes[c] for c in by_rate},
            run.train.batch_size,
            self.planned,
            "algo",
            delta_field=field,
            epsilon_field="algo.epsilon_train",
        )
        for cid in by_rate:
            self.plan[cid] = sigmas[cid], sample_rate(run.train.batch_size, sizes[cid])

    def _check_prompts(self) -> None:
        """Refuses a prompt budget that cuts a code's instruction.

        The model would not see the code: every code would be trained and generated from
        the same prompt.
        """
        for code in self.codes:
            instruction = self.cfg.prompt_template.format(code=code)
            if instruction not in self.fm.instruction_prompt(instruction):
                limit = self.fm.prompt_cfg.max_prompt_length
                raise ConfigError(
                    "task.prompt.max_prompt_length",
                    f"{limit} tokens cut the prompt of code {code!r} ({instruction!r}) short of"
                    " the code; raise it",
                )

    # ----- prompts and data -----
    def prompt(self, code: int) -> str:
        """The prompt of code ``code`` (as in training and generation)."""
        return self.fm.instruction_prompt(self.cfg.prompt_template.format(code=self.codes[code]))

    # ----- server half -----
    @override
    def setup(self, fed: Federation) -> dict[str, float]:
        """Round 0: DP profiling by every client."""
        cids = fed.client_ids()
        like = {"counts": {"counts": torch.zeros(len(self.codes), dtype=torch.float64)}}
        total = torch.zeros(len(self.codes), dtype=torch.float64)
        got = 0
        for cid in cids:  # every asked client ran the mechanism, answer or not
            self.privacy.add_gaussian(cid, self.sigma_profile, 1.0, name="profile", analytic=True)
        for _, r in fed.stream({c: Message("profile") for c in cids}, like=like):
            total += r.arrays["counts"]["counts"]
            got += 1
        self.require(fed, got, len(cids))
        self.profile = total.clamp_min(0)
        return {"clients": got, "profile_total": float(self.profile.sum())}

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        stage = self.stage(fed.rnd)
        if stage == "train":
            return self._train(fed)
        if stage == "generate":
            return self._generate()
        return self._vote(fed)

    def _train(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed, role=STRONG)
        msg = Message("train", {self.field: self.params})
        for cid in cids:  # every asked client ran DP-SGD as planned, answer or not
            sigma, rate = self.plan[cid]
            self.privacy.add_dp_sgd(cid, sigma, rate, self.run.train.steps, self.cfg.max_grad_norm)
        # Public weights: every client counts once.
        start = functools.partial(self.opt.round_sum, weight=equal_weight)
        like = {self.field: self.params}
        got = self.aggregate(fed, {c: msg for c in cids}, self.field, self.params, start, like)
        if got.result is not None:
            self.params = self.opt.apply_delta(self.params, got.result)
        out: dict[str, float] = {"clients": len(got.clients)}
        if self.start is not None:
            moved = {k: v - self.start[k] for k, v in self.params.items()}
            out["update_norm"] = update_norms([moved])[0]
        return out

    def _generate(self, tuned: bool = True) -> dict[str, float]:
        assert self.profile is not None, "profiling runs in round 0"
        allotment = allot(self.profile, self.cfg.num_samples)
        t0 = time.perf_counter()
        self.synthetic = self._sample(allotment, tuned)
        took = time.perf_counter() - t0
        empty = [self.codes[j] for j, s in enumerate(allotment) if s == 0]
        if empty:
            log.warning("dpsyn: no synthetic samples allotted to codes %s", ", ".join(empty))
        self.artefacts.write_text("synthetic_initial.jsonl", _jsonl(self.synthetic))
        self.artefacts.write_json(
            "profile.json",
            {"codes": self.codes, "noisy_profile": self.profile.tolist(), "allotment": allotment},
        )
        self.artefacts.write_json(HELDOUT, capable(self.task, ControlCodes).heldout())
        return {
            "synthetic": len(self.synthetic),
            "codes_without_samples": len(empty),
            # Share of samples cut by max_new_tokens (not ended by the model).
            "truncated": float(np.mean([r["truncated"] for r in self.synthetic]))
            if self.synthetic
            else 0.0,
            "time/generate_s": took,
        }

    def _sample(self, allotment: list[int], tuned: bool = True) -> list[dict[str, Any]]:
        """``allotment[j]`` texts of each code ``j``, seeded per code.

        ``tuned``: by the fine-tuned adapter or weights; otherwise by the base model.
        """
        with contextlib.ExitStack() as stack:
            adapters: list[str] = []
            if tuned and self.full:
                stack.enter_context(self.fm.full_weights(self.params))
            elif tuned:
                stack.enter_context(self.fm.slot(ADAPTER, {**self.frozen_a, **self.params}))
                adapters = [ADAPTER]
            return self._generate_codes(allotment, adapters)

    def _generate_codes(self, allotment: list[int], adapters: list[str]) -> list[dict[str, Any]]:
        labels = capable(self.task, ControlCodes).code_labels()
        out: list[dict[str, Any]] = []
        for j, s in enumerate(allotment):
            if s == 0:
                continue
            replies = self.fm.generate_replies(
                [self.prompt(j)] * s,
                adapters,
                seed=derive_seed(self.run.seed, "generate", j),
                cfg=self.cfg.generation,
            )
            out += [
                {
                    "id": len(out) + i,
                    "code": self.codes[j],
                    "code_id": j,
                    "label": labels[j],
                    "text": r.text,
                    "truncated": r.truncated,
                }
                for i, r in enumerate(replies)
            ]
        return out

    def _vote(self, fed: Federation) -> dict[str, float]:
        weak = [c for c in fed.client_ids() if fed.role_of(c) != STRONG]
        codes = np.asarray([row["code_id"] for row in self.synthetic], dtype=np.int64)
        total = np.zeros(len(self.synthetic), dtype=np.float64)
        got, vote_s = 0, 0.0
        if weak and self.synthetic:
            msg = Message(
                "vote",
                meta={
                    "texts": [row["text"] for row in self.synthetic],
                    "codes": codes.tolist(),
                },
            )
            like = {"votes": {"votes": torch.zeros(len(self.synthetic), dtype=torch.float64)}}
            for cid in weak:
                self.privacy.add_gaussian(cid, self.sigma_vote, 1.0, name="vote", analytic=True)
            t0 = time.perf_counter()
            for _, r in fed.stream({c: msg for c in weak}, like=like):
                total += r.arrays["votes"]["votes"].numpy()
                got += 1
            vote_s = time.perf_counter() - t0
            self.require(fed, got, len(weak))
        else:
            log.warning("dpsyn: no weak client to vote; the synthetic set is kept as generated")
        clipped = clip_votes(total, self.cfg.vote_threshold)
        assert self.profile is not None
        allotment = allot(self.profile, self.cfg.num_samples)
        seed = derive_seed(self.run.seed, "resample")
        kept, unvoted = select(clipped, codes, allotment, self.cfg, seed)
        if unvoted and got:
            log.warning(
                "dpsyn: codes %s got no votes; drawn uniformly", [self.codes[j] for j in unvoted]
            )
        self.final = [
            {**self.synthetic[i], "id": n, "source_id": self.synthetic[i]["id"]}
            for n, i in enumerate(kept)
        ]
        self.artefacts.write_text("synthetic.jsonl", _jsonl(self.final))
        self.artefacts.write_json(
            "votes.json", {"votes": total.tolist(), "clipped": clipped.tolist()}
        )
        return {
            "voters": got,
            "synthetic": len(self.final),
            "distinct_kept": len(set(kept)),
            "votes_total": float(clipped.sum()),
            "time/vote_clients_s": vote_s,
        }

    @override
    def finish(self, fed: Federation) -> dict[str, float]:
        """The summary's privacy figures, at the ledger's δ.

        Each mechanism's ε (worst client) and each role's composed ε (worst client of it).
        """
        if not len(self.privacy):
            return {}
        rep = self.privacy.report()
        out = {f"epsilon/{k}": v["epsilon_max"] for k, v in rep["mechanisms"].items()}
        for role in ("strong", "weak"):
            eps = [
                rec["epsilon"]
                for cid, rec in rep["clients"].items()
                if (fed.role_of(cid) == STRONG) == (role == "strong")
            ]
            if eps:
                out[f"epsilon/{role}"] = max(eps)
        return out

    # ----- evaluation -----
    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        if not self.cfg.eval.enabled:
            return {}
        stage = self.stage(fed.rnd)
        preds: dict[str, dict[str, np.ndarray]] = {}
        out: dict[str, Any] = {}
        if stage == "generate" and self.synthetic:
            with _timed(out, "time/eval_s"):
                out.update(self.scorer.scores(self.synthetic, "gen", preds))
            if self.cfg.eval.references:
                with _timed(out, "time/eval_real_s"):
                    out.update(self.scorer.references(preds))
            if self.cfg.eval.floor:
                assert self.profile is not None
                with _timed(out, "time/floor_s"):
                    floor = self._sample(allot(self.profile, self.cfg.num_samples), tuned=False)
                    scores = self.scorer.scores(floor, "floor", preds)
                out.update({f"floor/{k}": v for k, v in scores.items()})
        elif stage == "vote" and self.final:
            with _timed(out, "time/eval_s"):
                out.update(self.scorer.scores(self.final, "vote", preds))
        else:
            return {}
        if preds:
            out["items"] = self.scorer.items(preds)
        return out

    # ----- checkpointing -----
    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        groups = {self.field: self.params, "opt": self.opt.state_dict()}
        if self.profile is not None:
            groups["profile"] = {"p": self.profile}
        return join_groups(groups), {"synthetic": self.synthetic, "final": self.final}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, self.field)
        self.opt.load_state_dict(get_group(arrays, "opt"))
        profile = get_group(arrays, "profile")
        self.profile = profile["p"] if profile else None
        self.synthetic = list(meta.get("synthetic", []))
        self.final = list(meta.get("final", []))


@contextlib.contextmanager
def _timed(out: dict[str, Any], key: str) -> Iterator[None]:
    """Puts the seconds the block took in ``out[key]`` (a stage's share of the round time)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out[key] = time.perf_counter() - t0


def _jsonl(rows: list[dict[str, Any]]) -> str:
    import json

    return "".join(json.dumps(row) + "\n" for row in rows)


ALGORITHMS.register(
    "dpsyn", "DP federated text generation: strong clients DP-fine-tune, weak clients DP-vote"
)(DPSyn)
