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
FedSD alone is any server optimizer trained on ``(x, ỹ)`` instead of ``(x, y)``: a FedAvg-family
algorithm composes it as a phase (:class:`FedSDPhase`, ``algo.fedsd.enabled: true``).

The rewrites of the round-0 teacher are the same for every run that shares the model, the
client's data, the prompt settings and the decoding settings, so they are cached on disk
(:class:`RewriteCache`, one file per client data set) and a study pays for them once.

Choices of ours (the paper is silent):

* The instruction's input (``c``) is appended to the instruction in the prompt's
  ``### Instruction:`` block, separated by a blank line. The prompt is never cut: it may use
  ``refinery.max_prompt_length`` tokens (default: the model's context less the decoding
  budget, since a rewrite reads the whole reference), and a longer one falls back
  (``long_prompt``) without generating. ``task.prompt.max_prompt_length`` (the training and
  evaluation limit) does not apply to the teacher's prompt.
* Task checks by the row's ``metric``: ``gsm8k`` rows must keep the reference's final number,
  ``choice`` rows must name the reference's label first (:func:`fedfm.eval.metrics.pick_choice`);
  free-text (``rouge``) rows have no check. A leak is any of METHODS.md's phrases anywhere in the
  rewrite (case-insensitive) or a rewrite starting with "Your turn".
* Greedy decoding, 128 new tokens, by default; a rewrite that reaches the limit without its
  end-of-turn token falls back (``truncated``). The teacher at round 0 has ``B = 0`` in every
  adapter (it equals the base model), so the cache key names it ``base``; a teacher with
  trained adapters is keyed by a hash of its tensors.
* Length ratio: total words of the kept rewrites over total words of their references (a
  ratio of sums: a mean of per-row ratios is dominated by one-word labels restated as
  sentences); filler-word rate: share of words in :data:`FILLER_WORDS` (hedges, intensifiers
  and discourse markers), over the kept rewrites and over their references. Every statistic
  is also given per domain (``fedsd/<statistic>/<domain>``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from fedfm.algorithms.base import AlgoConfig
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.messages import MAX_EXAMPLES, Message, MessageKind, MetaSpec
from fedfm.core.seeding import derive_seed
from fedfm.errors import FedfmError
from fedfm.eval.metrics import gsm8k_number, pick_choice, resolve_answer
from fedfm.models.generation import GenerationConfig, Reply
from fedfm.registry import Registry
from fedfm.tasks.base import FOUNDATION_MODEL, HasFoundationModel, capable, require

if TYPE_CHECKING:
    from fedfm.algorithms.base import Algorithm
    from fedfm.fm import FoundationModel
    from fedfm.tasks.base import Task, TaskConfig
    from fedfm.tasks.lm import InstructionData

# ----------------------------------------------------------------------------- the prompt

REWRITE_SYSTEM = (
    "Below are an instruction that describes a task along with a reference answer. "
    "Using the reference answer as a guide, write your own response."
)
REWRITE_TEMPLATE = (
    "### Instruction:\n{instruction}\n\n### Reference Answer:\n{reference}\n\n### Response:\n"
)
LEAK_PHRASES = (
    "reference answer",
    "your response",
    "my response",
    "your own response",
    "now it's your turn",
)
LEAK_START = "your turn"
FALLBACK_REASONS = ("empty", "truncated", "leak", "number", "label", "long_prompt")
FILLER_WORDS = frozenset(
    {
        *("actually", "additionally", "basically", "certainly", "clearly", "definitely"),
        *("essentially", "furthermore", "generally", "honestly", "importantly", "indeed"),
        *("just", "literally", "moreover", "obviously", "overall", "quite", "rather"),
        *("really", "simply", "totally", "truly", "typically", "ultimately", "very", "well"),
    }
)
STATE_KEY = "fedsd"  # client-state meta: {"outputs": {row id: kept rewrite}}
CACHE_VERSION = 2  # 2: uncut prompts, and whether each rewrite hit the token limit


class RefineryConfig(BaseModel):
    """How the refinery rewrites (``algo.refinery`` of FedSDR, ``algo.fedsd`` of FedAvg).

    Attributes:
        decoding: Decoding settings of the rewrites.
        max_prompt_length: Tokens a rewrite prompt may take; a longer one falls back to the
            reference (``long_prompt``). ``None``: the model's context less
            ``decoding.max_new_tokens``.
        cache: Reuse cached rewrites of the same model, data and decoding settings.
        cache_dir: Folder of the cache; ``None``: ``$FEDFM_CACHE/fedsd`` or
            ``~/.cache/fedfm/fedsd``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    decoding: GenerationConfig = Field(default_factory=lambda: GenerationConfig(max_new_tokens=128))
    max_prompt_length: int | None = Field(None, ge=1)
    cache: bool = True
    cache_dir: str | None = None


class FedSDConfig(RefineryConfig):
    """FedSD as a phase of a FedAvg-family algorithm (``algo.fedsd``).

    Attributes:
        enabled: Rewrite every client's answers before round 1 and train on the rewrites.
    """

    enabled: bool = False


class FedSDOption(AlgoConfig):
    """The ``algo.fedsd`` section of an algorithm that composes :class:`FedSDPhase`."""

    fedsd: FedSDConfig = Field(default_factory=FedSDConfig)


# ----------------------------------------------------------------------------- the filter

RewriteCheck = Callable[[str, Mapping[str, Any]], str | None]
REWRITE_CHECKS: Registry[RewriteCheck] = Registry("rewrite check", "metric")
"""Task checks by a row's ``metric``: ``(rewrite, row) -> fallback reason or None``."""


def _reference(row: Mapping[str, Any]) -> str:
    answer = row.get("answer")
    return str(answer) if answer not in (None, "") else str(row["output"])


@REWRITE_CHECKS.register("gsm8k", help="the final number must equal the reference's")
def _same_number(rewrite: str, row: Mapping[str, Any]) -> str | None:
    ref = gsm8k_number(_reference(row))
    return None if ref is None or gsm8k_number(rewrite) == ref else "number"


@REWRITE_CHECKS.register("choice", help="the first label named must be the reference's")
def _same_label(rewrite: str, row: Mapping[str, Any]) -> str | None:
    choices = list(row.get("choices") or [])
    if not choices:
        return None
    gold = resolve_answer(_reference(row), choices)
    return None if pick_choice(rewrite, choices) == gold else "label"


def fallback_reason(rewrite: str, row: Mapping[str, Any], truncated: bool = False) -> str | None:
    """Why ``rewrite`` must not replace the row's answer (one of :data:`FALLBACK_REASONS`).

    Args:
        rewrite: The teacher's text.
        row: The instruction row (``output``, ``metric``, ``answer``, ``choices``).
        truncated: The rewrite reached its token limit without ending.

    Returns:
        ``"empty"``, ``"truncated"``, ``"leak"``, the task check's reason (``"number"``,
        ``"label"``), or ``None`` when the rewrite is kept.
    """
    text = rewrite.strip()
    if not text:
        return "empty"
    if truncated:
        return "truncated"
    low = text.lower()
    if any(p in low for p in LEAK_PHRASES) or low.startswith(LEAK_START):
        return "leak"
    metric = str(row.get("metric") or "")
    return REWRITE_CHECKS.get(metric)(text, row) if metric in REWRITE_CHECKS else None


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters, digits and underscores)."""
    return re.findall(r"\w+", text.lower())


def filler_rate(texts: Sequence[str]) -> float:
    """Share of the words of ``texts`` that are filler words (0 for no words)."""
    toks = [w for t in texts for w in words(t)]
    return sum(w in FILLER_WORDS for w in toks) / len(toks) if toks else 0.0


COUNTS = (
    "n",
    "kept",
    "checked",
    "answer_kept",
    *(f"fallback_{r}" for r in FALLBACK_REASONS),
    "words_raw",
    "words_distilled",
    "filler_raw",
    "filler_distilled",
)
"""What a client counts per domain: rows, kept rewrites, checked rows and those keeping the
answer, fallbacks by reason, and words and filler words of the kept rewrites and of their
references."""


@dataclass
class RewriteStats:
    """What leaves a client: counts per domain, never a text.

    Attributes:
        counts: ``{domain: {name: count}}`` for every name of :data:`COUNTS`.
        cached: Whether the rewrites came from the cache.
    """

    counts: dict[str, dict[str, int]]
    cached: bool = False

    def total(self, name: str) -> int:
        """Count ``name`` over every domain."""
        return sum(c[name] for c in self.counts.values())

    @property
    def n(self) -> int:
        """Rows."""
        return self.total("n")

    @property
    def kept(self) -> int:
        """Kept rewrites."""
        return self.total("kept")

    @property
    def fallbacks(self) -> dict[str, int]:
        """Fallbacks to the reference by reason."""
        return {r: self.total(f"fallback_{r}") for r in FALLBACK_REASONS}

    def rates(self) -> dict[str, float]:
        """``length_ratio``, ``filler_raw`` and ``filler_distilled`` over every domain."""
        return _rates({k: float(self.total(k)) for k in COUNTS})

    def meta(self) -> dict[str, Any]:
        """The reply's meta fields (see :data:`REFINE`)."""
        out: dict[str, Any] = {
            "num_examples": self.n,
            "kept": self.kept,
            "checked": self.total("checked"),
            "answer_kept": self.total("answer_kept"),
            **self.rates(),
            "cached": self.cached,
            "by_domain": {
                f"{d}/{k}": v for d, c in sorted(self.counts.items()) for k, v in c.items()
            },
        }
        out.update({f"fallback_{r}": n for r, n in self.fallbacks.items()})
        return out


def _rates(c: Mapping[str, float]) -> dict[str, float]:
    words_raw = c.get("words_raw", 0.0)
    words = c.get("words_distilled", 0.0)
    return {
        "length_ratio": words / words_raw if words_raw else 0.0,
        "filler_raw": c.get("filler_raw", 0.0) / words_raw if words_raw else 0.0,
        "filler_distilled": c.get("filler_distilled", 0.0) / words if words else 0.0,
    }


def refine_rows(
    rows: Sequence[Mapping[str, Any]], rewrites: Sequence[Reply | str | None]
) -> tuple[dict[str, str], RewriteStats]:
    """Filters the rewrites of ``rows``: the kept ones by row id, and the statistics.

    Args:
        rows: Instruction rows with ``id, output, metric`` (and ``answer, choices, domain``).
        rewrites: One teacher reply per row, in order; a plain string is a reply that ended
            by itself, ``None`` a row whose prompt did not fit (``long_prompt``).

    Returns:
        ``({str(id): rewrite}`` of the kept rewrites, statistics).
    """
    if len(rows) != len(rewrites):
        raise FedfmError(f"{len(rewrites)} rewrites for {len(rows)} rows")
    kept: dict[str, str] = {}
    counts: dict[str, dict[str, int]] = {}
    for row, got in zip(rows, rewrites, strict=True):
        c = counts.setdefault(str(row.get("domain") or "all"), dict.fromkeys(COUNTS, 0))
        c["n"] += 1
        if got is None:
            c["fallback_long_prompt"] += 1
            continue
        reply = Reply(got, False) if isinstance(got, str) else got
        text = reply.text
        reason = fallback_reason(text, row, reply.truncated)
        metric = str(row.get("metric") or "")
        if metric in REWRITE_CHECKS:
            c["checked"] += 1
            # The answer is kept when the text passes the task check (an empty, cut or
            # leaking rewrite is judged on its text all the same).
            c["answer_kept"] += REWRITE_CHECKS.get(metric)(text.strip(), row) is None
        if reason is not None:
            c[f"fallback_{reason}"] += 1
            continue
        kept[str(row["id"])] = text.strip()
        ref, new = words(str(row["output"])), words(text)
        c["kept"] += 1
        c["words_raw"] += len(ref)
        c["words_distilled"] += len(new)
        c["filler_raw"] += sum(w in FILLER_WORDS for w in ref)
        c["filler_distilled"] += sum(w in FILLER_WORDS for w in new)
    return kept, RewriteStats(counts)


# ----------------------------------------------------------------------------- the cache


def default_cache_dir() -> Path:
    """``$FEDFM_CACHE/fedsd``, else ``~/.cache/fedfm/fedsd``."""
    root = os.environ.get("FEDFM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "fedfm") / "fedsd"


class RewriteCache:
    """Rewrites on disk, one JSON file per key; writes are atomic (temporary file, rename).

    Args:
        folder: Where the files live (created on the first write).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.folder / f"{key}.json"

    def get(self, key: str) -> list[Reply | None] | None:
        """The cached rewrites of ``key``, or ``None`` (also for an unreadable file)."""
        try:
            saved = json.loads(self.path(key).read_text())
            texts, cut = saved["rewrites"], saved["truncated"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return None
        if not isinstance(texts, list) or not isinstance(cut, list) or len(texts) != len(cut):
            return None
        return [
            None if t is None else Reply(str(t), bool(c)) for t, c in zip(texts, cut, strict=True)
        ]

    def put(self, key: str, rewrites: Sequence[Reply | None]) -> None:
        """Stores ``rewrites`` under ``key``; concurrent writers leave one whole file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp")
        body = {
            "version": CACHE_VERSION,
            "rewrites": [None if r is None else r.text for r in rewrites],
            "truncated": [r is not None and r.truncated for r in rewrites],
        }
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def teacher_digest(arrays: Mapping[str, Tensor]) -> str:
    """What the cache key calls a teacher.

    ``"base"`` when every ``lora_B`` tensor is zero (its adapters change nothing), else a
    SHA-256 of the tensors.
    """
    if all(not bool(v.any()) for k, v in arrays.items() if "lora_B" in k):
        return "base"
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(arrays[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def cache_key(
    fm: FoundationModel,
    rows: Sequence[Mapping[str, Any]],
    decoding: GenerationConfig,
    teacher: str,
    seed: int,
    prompt_budget: int | None = None,
) -> str:
    """The key of a client's rewrites: model, prompt settings, decoding, teacher and data."""
    spec = {
        "version": CACHE_VERSION,
        "model": fm.key,
        "autocast_bf16": fm.autocast_bf16,
        "prompt": fm.prompt_cfg.model_dump(),
        "prompt_budget": prompt_budget,
        "system": REWRITE_SYSTEM,
        "template": REWRITE_TEMPLATE,
        "decoding": decoding.model_dump(),
        "seed": seed if decoding.do_sample else None,  # greedy decoding ignores the seed
        "teacher": teacher,
        "rows": [[str(r["id"]), _instruction(r), str(r["output"])] for r in rows],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


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


def _instruction(row: Mapping[str, Any]) -> str:
    extra = str(row.get("input") or "")
    return f"{row['instruction']}\n\n{extra}" if extra else str(row["instruction"])


def rewrite_prompts(
    fm: FoundationModel, rows: Sequence[Mapping[str, Any]], budget: int
) -> list[str | None]:
    """The SDFT rewrite prompt of each row, whole, or ``None`` where it exceeds ``budget``.

    A teacher that reads a reference with its middle cut out rewrites something else, so a
    prompt is never cut: a row that does not fit falls back to its reference.
    """
    prompts: list[str | None] = []
    for r in rows:
        fields = {"instruction": _instruction(r), "reference": str(r["output"])}
        text, n = fm.full_prompt(REWRITE_TEMPLATE, fields, system=REWRITE_SYSTEM)
        prompts.append(text if n <= budget else None)
    return prompts


def check_refinery_task(task_cls: type[Task], task_cfg: TaskConfig, field: str) -> None:
    """Refuses at config load a task whose model cannot rewrite (no foundation model)."""
    require(task_cls, task_cfg, FOUNDATION_MODEL, field, "FedSD's rewrites")


@dataclass
class Refinery:
    """Both halves of the round-0 exchange and the distilled sets of this process's clients.

    Each half of an algorithm builds its own from the config: the server's runs the exchange
    (:meth:`run`), the client's rewrites and keeps the distilled sets it has encoded.

    Args:
        cfg: Decoding and cache settings.
    """

    cfg: RefineryConfig
    _memo: dict[str, tuple[str, InstructionData]] = field(default_factory=dict, repr=False)

    # ----- client half -----
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
        kept, stats = refine_rows(rows, texts)
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
        cache = RewriteCache(
            Path(self.cfg.cache_dir) if self.cfg.cache_dir else default_cache_dir()
        )
        budget = self.prompt_budget(fm)
        key = cache_key(fm, rows, self.cfg.decoding, teacher, seed, budget)
        if self.cfg.cache and (hit := cache.get(key)) is not None and len(hit) == len(rows):
            return hit, True
        prompts = rewrite_prompts(fm, rows, budget)
        todo = {i: p for i, p in enumerate(prompts) if p is not None}
        replies: list[Reply | None] = [None] * len(rows)
        if todo:
            got = fm.generate_replies(
                list(todo.values()), adapters, seed=seed, cfg=self.cfg.decoding
            )
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
        if self.cfg.cache:
            cache.put(key, replies)
        return replies, False

    def prompt_budget(self, fm: FoundationModel) -> int:
        """Tokens a rewrite prompt may take (see :class:`RefineryConfig`)."""
        if self.cfg.max_prompt_length is not None:
            return self.cfg.max_prompt_length
        return max(fm.context_length - self.cfg.decoding.max_new_tokens, 1)

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

    # ----- server half -----
    def run(
        self, algo: Algorithm, fed: Federation, teacher: Mapping[str, Tensor]
    ) -> dict[str, float]:
        """Round 0: every client rewrites its data with ``teacher``; logs the statistics.

        Per-client statistics go to ``artefacts/fedsd/rewrite_stats.json``.

        Returns:
            ``fedsd/kept_share``, ``fedsd/fallback_<reason>`` (shares of all rows),
            ``fedsd/answer_kept`` (share of checked rows), ``fedsd/length_ratio`` (mean over
            clients weighted by kept rows), ``fedsd/filler_raw``, ``fedsd/filler_distilled``,
            ``fedsd/cached_clients``.
        """
        cids = fed.client_ids()
        replies = fed.broadcast(Message("refine", {"params": dict(teacher)}), cids)
        algo.require(fed, replies, len(cids))
        per = {c: dict(r.meta) for c, r in replies.items()}
        total = summarise_rewrites(list(per.values()))
        algo.artefacts.write_json("fedsd/rewrite_stats.json", {"total": total, "clients": per})
        return {f"fedsd/{k}": v for k, v in total.items()}


class FedSDPhase:
    """FedSD as a phase any FedAvg-family algorithm composes, all of it in one place.

    Its message kind (:attr:`kinds`), its check of the task (:meth:`check_task`), its round-0
    server step (:meth:`setup`), its client handler (:meth:`handlers`) and the distilled set
    that replaces the client's data in local training (:meth:`train_data`). An algorithm
    composes it by taking :class:`FedSDOption` in its config and :attr:`kinds` in its
    messages; its server half calls :meth:`setup` in its own ``setup``, its client half adds
    :meth:`handlers` and trains on :meth:`train_data`. Each half builds its own phase from the
    config; with ``algo.fedsd.enabled: false`` every step does nothing.

    Args:
        cfg: The algorithm's config (an :class:`FedSDOption` holds ``fedsd``; any other
            config leaves FedSD off).
    """

    kinds: ClassVar[tuple[MessageKind, ...]] = (REFINE,)

    def __init__(self, cfg: AlgoConfig) -> None:
        fedsd = cfg.fedsd if isinstance(cfg, FedSDOption) else None
        self.refinery = Refinery(fedsd) if fedsd is not None and fedsd.enabled else None

    @staticmethod
    def check_task(cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        """Refuses at config load a task whose model cannot rewrite, when FedSD is on."""
        if isinstance(cfg, FedSDOption) and cfg.fedsd.enabled:
            check_refinery_task(task_cls, task_cfg, "algo.fedsd.enabled")

    # ----- server half -----
    def setup(
        self, algo: Algorithm, fed: Federation, teacher: Mapping[str, Tensor]
    ) -> dict[str, float]:
        """Round 0: every client rewrites its answers with the global ``teacher`` parameters.

        See :meth:`Refinery.run`; nothing when FedSD is off.
        """
        return {} if self.refinery is None else self.refinery.run(algo, fed, teacher)

    # ----- client half -----
    def handlers(self, task: Task, model: nn.Module) -> dict[str, Handler]:
        """The ``refine`` handler: the received parameters rewrite the client's answers.

        They are loaded into ``model`` (the task's foundation model, its active adapters).
        """
        refinery = self.refinery
        if refinery is None:
            return {}

        def refine(ctx: ClientContext, msg: Message) -> Message:
            task.set_params(model, msg.arrays["params"])
            fm = capable(task, HasFoundationModel).foundation_model()
            return refinery.rewrite(ctx, fm, fm.active, msg.arrays["params"])

        return {"refine": refine}

    def train_data(self, ctx: ClientContext) -> InstructionData | None:
        """What the client trains on: its distilled set with FedSD, else None (its data)."""
        return None if self.refinery is None else self.refinery.data(ctx)


def _num(meta: Mapping[str, Any], key: str) -> float:
    value = meta.get(key, 0)
    return float(value) if isinstance(value, int | float) else 0.0


def summarise_rewrites(stats: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Pools the clients' rewrite statistics (the meta of :data:`REFINE` replies).

    Counts are summed over clients, per domain and in all, and turned into shares: of all rows
    for ``kept_share`` and the fallbacks, of checked rows for ``answer_kept``, and of words for
    the length ratio and the filler rates (:func:`refine_rows`).

    Returns:
        ``rows``, ``kept_share``, ``fallback_<reason>``, ``answer_kept``, ``length_ratio``,
        ``filler_raw``, ``filler_distilled`` and each of them ``/<domain>``, and
        ``cached_clients``.
    """
    by_domain: dict[str, dict[str, float]] = {}
    for s in stats:
        for key, value in dict(s.get("by_domain") or {}).items():
            domain, _, name = str(key).rpartition("/")
            c = by_domain.setdefault(domain, dict.fromkeys(COUNTS, 0.0))
            c[name] = c.get(name, 0.0) + float(value)
    total = {k: sum(c.get(k, 0.0) for c in by_domain.values()) for k in COUNTS}
    out = _shares(total)
    for domain, c in sorted(by_domain.items()):
        out.update({f"{k}/{domain}": v for k, v in _shares(c).items()})
    out["cached_clients"] = float(sum(bool(s.get("cached")) for s in stats))
    return out


def _shares(c: Mapping[str, float]) -> dict[str, float]:
    n, checked = c.get("n", 0.0), c.get("checked", 0.0)
    return {
        "rows": n,
        "kept_share": c.get("kept", 0.0) / n if n else 0.0,
        **{
            f"fallback_{r}": c.get(f"fallback_{r}", 0.0) / n if n else 0.0 for r in FALLBACK_REASONS
        },
        "answer_kept": c.get("answer_kept", 0.0) / checked if checked else 0.0,
        **_rates(c),
    }
