"""FedSD: the data refinery of FedSDR, a round-0 exchange any FedAvg-style algorithm can run.

Paper: "FedSDR: Federated Self-Distillation with Rectification" (ICML 2026, arXiv 2605.18028),
the data-level half ("FedSD"). The rewrite prompt is SDFT's (Yang et al. 2024, "Self-Distillation
Bridges Distribution Gap in Language Model Fine-Tuning", sail-sg/sdft).

Once before round 1, every client rewrites each answer ``y`` of its data with the global model
as teacher, prompted with the instruction ``x`` and ``y`` as a reference:
``ỹ ~ f(· | x, y)``. A rewrite that is empty, stops at its token limit (an answer cut short,
which training would close with an end-of-turn token: teaching the model to stop mid-answer),
leaks the prompt or fails the task check falls back to ``y``, and so does a row whose prompt
would not fit the teacher's prompt budget (its reference is never cut in the middle); each
fallback is counted by reason. The distilled set ``D_dist`` lives in the client's persistent
state (it survives resume) and is reused every round; only statistics leave the client (kept
share, fallbacks by reason, answer-keeping share, length ratio, filler-word rates; overall and
per domain, as counts).
FedSD alone is any server optimizer trained on ``(x, ỹ)`` instead of ``(x, y)``. One class,
:class:`FedSD`, holds both halves of the exchange and the distilled sets, and one config section
holds its settings for every algorithm that runs it: ``algo.fedsd`` (:class:`FedSDConfig`). A
FedAvg-family algorithm turns it on with ``algo.fedsd.enabled: true``; FedSDR always runs it
(its old key ``algo.refinery`` is still read, as an alias). The prompt, the filter, the
statistics and the cache are :mod:`fedfm.algorithms.rewrite`.

The rewrites of the round-0 teacher are the same for every run that shares the model, the
client's data, the prompt settings and the decoding settings, so they are cached on disk
(:class:`~fedfm.algorithms.rewrite.RewriteCache`, one file per client data set) and a study
pays for them once.

Choices of ours (the paper is silent):

* The instruction's input (``c``) is appended to the instruction in the prompt's
  ``### Instruction:`` block, separated by a blank line. The prompt is never cut: it may use
  ``fedsd.max_prompt_length`` tokens (default: the model's context less the decoding
  budget, since a rewrite reads the whole reference), and a longer one falls back
  (``long_prompt``) without generating. ``task.prompt.max_prompt_length`` (the training and
  evaluation limit) does not apply to the teacher's prompt.
* Task checks by the row's ``metric``: ``gsm8k`` rows must keep the reference's final number,
  ``choice`` rows must name the reference's label first (:func:`fedfm.eval.metrics.pick_choice`);
  free-text (``rouge``) rows have no check. With ``fedsd.keep_reasoning`` (off by default), a
  ``gsm8k`` rewrite must also keep that share of the reference's reasoning words (its chain of
  thought; a rewrite that states only the number teaches answering without reasoning), else
  the row falls back (``reasoning``). A leak is any of METHODS.md's phrases anywhere in the
  rewrite (case-insensitive) or a rewrite starting with "Your turn".
* Greedy decoding, 128 new tokens, by default; a rewrite that reaches the limit without its
  end-of-turn token falls back (``truncated``). The teacher at round 0 has ``B = 0`` in every
  adapter (it equals the base model), so the cache key names it ``base``; a teacher with
  trained adapters is keyed by a hash of its tensors.
* Length ratio: total words of the kept rewrites over total words of their references (a
  ratio of sums: a mean of per-row ratios is dominated by one-word labels restated as
  sentences); filler-word rate: share of words in
  :data:`~fedfm.algorithms.rewrite.FILLER_WORDS` (hedges, intensifiers
  and discourse markers), over the kept rewrites and over their references. Every statistic
  is also given per domain (``fedsd/<statistic>/<domain>``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor, nn

from fedfm.algorithms.base import AlgoConfig
from fedfm.algorithms.rewrite import (
    FALLBACK_REASONS,
    RewriteCache,
    cache_key,
    default_cache_dir,
    refine_rows,
    rewrite_prompts,
    summarise_rewrites,
    teacher_digest,
)
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.messages import MAX_EXAMPLES, Message, MessageKind, MetaSpec
from fedfm.core.seeding import derive_seed
from fedfm.errors import FedfmError
from fedfm.models.generation import GenerationConfig, Reply
from fedfm.tasks.base import FOUNDATION_MODEL, HasFoundationModel, capable, require

if TYPE_CHECKING:
    from fedfm.algorithms.base import Algorithm
    from fedfm.fm import FoundationModel
    from fedfm.tasks.base import Task, TaskConfig
    from fedfm.tasks.lm import InstructionData

STATE_KEY = "fedsd"  # client-state meta: {"outputs": {row id: kept rewrite}}
OLD_KEY = "refinery"  # FedSDR's former name of ``algo.fedsd``, still accepted


class FedSDConfig(BaseModel):
    """FedSD's settings (``algo.fedsd``, of every algorithm that runs it).

    Attributes:
        enabled: Rewrite every client's answers before round 1 and train on the rewrites
            (FedSDR: always).
        decoding: Decoding settings of the rewrites.
        max_prompt_length: Tokens a rewrite prompt may take; a longer one falls back to the
            reference (``long_prompt``). ``None``: the model's context less
            ``decoding.max_new_tokens``.
        cache: Reuse cached rewrites of the same model, data and decoding settings.
        cache_dir: Folder of the cache; ``None``: ``$FEDFM_CACHE/fedsd`` or
            ``~/.cache/fedfm/fedsd``.
        keep_reasoning: Ours, not the paper's: a GSM8K rewrite is kept only if, beside its
            right final number, it keeps at least this share of the reference's reasoning
            words (:func:`~fedfm.algorithms.rewrite.reasoning_words`); otherwise the row
            falls back to its reference (``reasoning``). ``None``: the paper's filter.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    decoding: GenerationConfig = Field(default_factory=lambda: GenerationConfig(max_new_tokens=128))
    max_prompt_length: int | None = Field(None, ge=1)
    cache: bool = True
    cache_dir: str | None = None
    keep_reasoning: float | None = Field(None, gt=0, le=10)


class FedSDAlways(FedSDConfig):
    """``algo.fedsd`` of an algorithm that always runs FedSD (FedSDR): on, and cannot be off."""

    enabled: bool = True

    @field_validator("enabled")
    @classmethod
    def _on(cls, v: bool) -> bool:
        if not v:
            raise ValueError(
                "this algorithm always rewrites (FedSD off is FedIT: algorithm=fedavg)"
            )
        return v


class FedSDOption(AlgoConfig):
    """The ``algo.fedsd`` section of an algorithm that may run FedSD (off by default)."""

    fedsd: FedSDConfig = Field(default_factory=FedSDConfig)


class FedSDRequired(AlgoConfig):
    """The ``algo.fedsd`` section of an algorithm that always runs FedSD.

    Its old name ``algo.refinery`` is read as ``algo.fedsd`` (giving both is refused).
    """

    fedsd: FedSDAlways = Field(default_factory=FedSDAlways)

    @model_validator(mode="before")
    @classmethod
    def _old_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and OLD_KEY in data:
            if "fedsd" in data:
                raise ValueError(f"give fedsd or its old name {OLD_KEY}, not both")
            data = {("fedsd" if k == OLD_KEY else k): v for k, v in data.items()}
        return data


# ----------------------------------------------------------------------------- the exchange

_COUNT = MetaSpec("int", ge=0, le=MAX_EXAMPLES, required=True)
_RATE = MetaSpec("float", ge=0, le=1, required=True)
REFINE = MessageKind(
    "refine",
    down_arrays=("params",),
    up_meta=(
        "num_examples",
        "kept",
        "checked",
        "answer_kept",
        "length_ratio",
        "filler_raw",
        "filler_distilled",
        "cached",
        "by_domain",
        *(f"fallback_{r}" for r in FALLBACK_REASONS),
    ),
    no_grad=True,
    meta_specs={
        "num_examples": MetaSpec("int", ge=0, le=MAX_EXAMPLES, required=True),
        "kept": _COUNT,
        "checked": _COUNT,
        "answer_kept": _COUNT,
        "length_ratio": MetaSpec("float", ge=0, required=True),
        "filler_raw": _RATE,
        "filler_distilled": _RATE,
        "cached": MetaSpec("bool", required=True),
        "by_domain": MetaSpec("metrics", required=True),
        **{f"fallback_{r}": _COUNT for r in FALLBACK_REASONS},
    },
)
"""Round 0: the teacher's adapters go down; only the statistics come back."""


def fedsd_settings(cfg: AlgoConfig) -> FedSDConfig | None:
    """``algo.fedsd`` of ``cfg`` when FedSD is on, else ``None``."""
    fedsd = getattr(cfg, "fedsd", None)
    return fedsd if isinstance(fedsd, FedSDConfig) and fedsd.enabled else None


class FedSD:
    """FedSD, all of it in one place: both halves of the round-0 exchange and the distilled sets.

    Its message kind (:attr:`kinds`), its check of the task (:meth:`check_task`), its round-0
    server step (:meth:`setup`), its client step (:meth:`rewrite`, or the ``refine`` handler of
    :meth:`handlers`) and the distilled set a client trains on (:meth:`data`,
    :meth:`train_data`). Each half of an algorithm builds its own from the config; with FedSD
    off (``algo.fedsd.enabled: false``, or a config without ``fedsd``) every step does nothing.

    Args:
        cfg: The algorithm's config (its ``fedsd`` section).
    """

    kinds: ClassVar[tuple[MessageKind, ...]] = (REFINE,)

    def __init__(self, cfg: AlgoConfig) -> None:
        self.cfg = fedsd_settings(cfg)
        self._memo: dict[str, tuple[str, InstructionData]] = {}

    @property
    def on(self) -> bool:
        """Whether this run rewrites."""
        return self.cfg is not None

    @staticmethod
    def check_task(
        cfg: AlgoConfig,
        task_cls: type[Task],
        task_cfg: TaskConfig,
        field: str = "algo.fedsd.enabled",
    ) -> None:
        """Refuses at config load a task whose model cannot rewrite, when FedSD is on."""
        if fedsd_settings(cfg) is not None:
            require(task_cls, task_cfg, FOUNDATION_MODEL, field, "FedSD's rewrites")

    # ----- server half -----
    def setup(
        self, algo: Algorithm, fed: Federation, teacher: Mapping[str, Tensor]
    ) -> dict[str, float]:
        """Round 0: every client rewrites its data with ``teacher``; logs the statistics.

        Per-client statistics go to ``artefacts/fedsd/rewrite_stats.json``; nothing when
        FedSD is off.

        Returns:
            ``fedsd/kept_share``, ``fedsd/fallback_<reason>`` (shares of all rows),
            ``fedsd/answer_kept`` (share of checked rows), ``fedsd/length_ratio`` (mean over
            clients weighted by kept rows), ``fedsd/filler_raw``, ``fedsd/filler_distilled``,
            ``fedsd/cached_clients``.
        """
        if self.cfg is None:
            return {}
        cids = fed.client_ids()
        replies = fed.broadcast(Message("refine", {"params": dict(teacher)}), cids)
        algo.require(fed, replies, len(cids))
        per = {c: dict(r.meta) for c, r in replies.items()}
        total = summarise_rewrites(list(per.values()))
        algo.artefacts.write_json("fedsd/rewrite_stats.json", {"total": total, "clients": per})
        return {f"fedsd/{k}": v for k, v in total.items()}

    # ----- client half -----
    def handlers(self, task: Task, model: nn.Module) -> dict[str, Handler]:
        """The ``refine`` handler of a single-model algorithm (none when FedSD is off).

        The received parameters, loaded into ``model`` (the task's foundation model, its
        active adapters), rewrite the client's answers.
        """
        if self.cfg is None:
            return {}

        def refine(ctx: ClientContext, msg: Message) -> Message:
            task.set_params(model, msg.arrays["params"])
            fm = capable(task, HasFoundationModel).foundation_model()
            return self.rewrite(ctx, fm, fm.active, msg.arrays["params"])

        return {"refine": refine}

    def rewrite(
        self,
        ctx: ClientContext,
        fm: FoundationModel,
        adapters: Sequence[str],
        teacher: Mapping[str, Tensor],
    ) -> Message:
        """Rewrites the client's answers; only the statistics leave the client.

        The kept rewrites (the distilled set) go to ``ctx.state``.

        Args:
            ctx: The client's context.
            fm: The foundation model, the teacher's adapters already loaded.
            adapters: The teacher's adapters.
            teacher: The teacher's tensors, for the cache key.
        """
        rows = [dict(r) for r in ctx.data.rows]
        seed = derive_seed(ctx.seed, ctx.cid, "fedsd-rewrite")
        texts, cached = self._texts(fm, rows, adapters, teacher_digest(teacher), seed)
        kept, stats = refine_rows(rows, texts, self._settings().keep_reasoning)
        stats.cached = cached
        ctx.state.meta[STATE_KEY] = {"outputs": kept}
        return Message("refine", meta=stats.meta())

    def _texts(
        self,
        fm: FoundationModel,
        rows: list[dict[str, Any]],
        adapters: Sequence[str],
        teacher: str,
        seed: int,
    ) -> tuple[list[Reply | None], bool]:
        cfg = self._settings()
        cache = RewriteCache(Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir())
        budget = self.prompt_budget(fm)
        key = cache_key(fm, rows, cfg.decoding, teacher, seed, budget)
        if cfg.cache and (hit := cache.get(key)) is not None and len(hit) == len(rows):
            return hit, True
        prompts = rewrite_prompts(fm, rows, budget)
        todo = {i: p for i, p in enumerate(prompts) if p is not None}
        replies: list[Reply | None] = [None] * len(rows)
        if todo:
            got = fm.generate_replies(list(todo.values()), adapters, seed=seed, cfg=cfg.decoding)
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
        if cfg.cache:
            cache.put(key, replies)
        return replies, False

    def _settings(self) -> FedSDConfig:
        if self.cfg is None:
            raise FedfmError("FedSD is off (algo.fedsd.enabled: false)")
        return self.cfg

    def prompt_budget(self, fm: FoundationModel) -> int:
        """Tokens a rewrite prompt may take (see :class:`FedSDConfig`)."""
        cfg = self._settings()
        if cfg.max_prompt_length is not None:
            return cfg.max_prompt_length
        return max(fm.context_length - cfg.decoding.max_new_tokens, 1)

    def data(self, ctx: ClientContext) -> InstructionData:
        """The client's distilled set ``D_dist`` (its raw data with the kept rewrites).

        Raises:
            FedfmError: The client has no distilled set (it missed the round-0 exchange).
        """
        saved = ctx.state.meta.get(STATE_KEY)
        if not isinstance(saved, dict) or not isinstance(saved.get("outputs"), dict):
            raise FedfmError(f"client {ctx.cid} has no distilled set (it missed round 0)")
        outputs: dict[str, str] = saved["outputs"]
        digest = hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()
        memo = self._memo.get(ctx.cid)
        if memo is None or memo[0] != digest:  # encoded once per process, not every round
            memo = (digest, ctx.data.with_outputs(outputs))
            self._memo[ctx.cid] = memo
        return memo[1]

    def train_data(self, ctx: ClientContext) -> InstructionData | None:
        """What the client trains on: its distilled set with FedSD, else None (its data)."""
        return None if self.cfg is None else self.data(ctx)
