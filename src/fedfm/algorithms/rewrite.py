"""FedSD's rewrite machinery: the SDFT prompt, the filter, the statistics and the cache.

What a client does with the teacher's rewrites of its answers (:mod:`fedfm.algorithms.fedsd`
runs the exchange): the prompt of each row (SDFT's, Yang et al. 2024, "Self-Distillation
Bridges Distribution Gap in Language Model Fine-Tuning", sail-sg/sdft), the checks that make a
rewrite fall back to its reference (:func:`fallback_reason`, :data:`REWRITE_CHECKS`), the
counts that are all that leaves the client (:class:`RewriteStats`) and their pooling by the
server (:func:`summarise_rewrites`), and the on-disk cache of the round-0 rewrites
(:class:`RewriteCache`, :func:`cache_key`). The choices of ours are listed in
:mod:`fedfm.algorithms.fedsd`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from fedfm.errors import FedfmError
from fedfm.eval.metrics import gsm8k_number, pick_choice, resolve_answer
from fedfm.models.generation import GenerationConfig, Reply
from fedfm.registry import Registry

if TYPE_CHECKING:
    from fedfm.fm import FoundationModel

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
FALLBACK_REASONS = ("empty", "truncated", "leak", "number", "label", "long_prompt", "reasoning")
FILLER_WORDS = frozenset(
    {
        *("actually", "additionally", "basically", "certainly", "clearly", "definitely"),
        *("essentially", "furthermore", "generally", "honestly", "importantly", "indeed"),
        *("just", "literally", "moreover", "obviously", "overall", "quite", "rather"),
        *("really", "simply", "totally", "truly", "typically", "ultimately", "very", "well"),
    }
)
CACHE_VERSION = 2  # 2: uncut prompts, and whether each rewrite hit the token limit


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


# Ours, not the paper's (FedSD keeps any rewrite whose final number is right): a GSM8K
# rewrite may drop the chain of thought and keep the number, so that training on it teaches
# the model to answer without reasoning.
ReasoningCheck = Callable[[str, Mapping[str, Any], float], bool]
REASONING_CHECKS: Registry[ReasoningCheck] = Registry("reasoning check", "metric")
"""Whether a rewrite keeps its reference's reasoning, by a row's ``metric``:
``(rewrite, row, min_share) -> bool`` (the acceptance rule of ``algo.fedsd.keep_reasoning``)."""

_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 48/2=<<48/2=24>>24


def reasoning_words(text: str) -> list[str]:
    """The words of a GSM8K solution's reasoning: without its ``#### N`` line and annotations.

    The final-answer line after the last ``####`` is dropped and so are the calculator
    annotations ``<<…>>`` of GSM8K's references (they restate a step's arithmetic), so that a
    reference and a rewrite are counted alike.
    """
    body = text.rsplit("####", 1)[0] if "####" in text else text
    return words(_CALCULATOR.sub(" ", body))


@REASONING_CHECKS.register("gsm8k", help="the rewrite keeps a share of the reference's reasoning")
def _keeps_chain_of_thought(rewrite: str, row: Mapping[str, Any], min_share: float) -> bool:
    """At least ``min_share`` × the reference's reasoning words (:func:`reasoning_words`)."""
    need = min_share * len(reasoning_words(str(row["output"])))
    return len(reasoning_words(rewrite)) >= need


def fallback_reason(
    rewrite: str,
    row: Mapping[str, Any],
    truncated: bool = False,
    keep_reasoning: float | None = None,
) -> str | None:
    """Why ``rewrite`` must not replace the row's answer (one of :data:`FALLBACK_REASONS`).

    Args:
        rewrite: The teacher's text.
        row: The instruction row (``output``, ``metric``, ``answer``, ``choices``).
        truncated: The rewrite reached its token limit without ending.
        keep_reasoning: Ours (``algo.fedsd.keep_reasoning``): a row whose metric has a
            reasoning check (GSM8K) keeps its rewrite only if the rewrite has at least this
            share of the reference's reasoning words; ``None``: no such check (the paper's).

    Returns:
        ``"empty"``, ``"truncated"``, ``"leak"``, the task check's reason (``"number"``,
        ``"label"``), ``"reasoning"``, or ``None`` when the rewrite is kept.
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
    if metric in REWRITE_CHECKS and (reason := REWRITE_CHECKS.get(metric)(text, row)):
        return reason
    if keep_reasoning is not None and metric in REASONING_CHECKS:
        return None if REASONING_CHECKS.get(metric)(text, row, keep_reasoning) else "reasoning"
    return None


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters, digits and underscores)."""
    return re.findall(r"\w+", text.lower())


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
    rows: Sequence[Mapping[str, Any]],
    rewrites: Sequence[Reply | str | None],
    keep_reasoning: float | None = None,
) -> tuple[dict[str, str], RewriteStats]:
    """Filters the rewrites of ``rows``: the kept ones by row id, and the statistics.

    Args:
        rows: Instruction rows with ``id, output, metric`` (and ``answer, choices, domain``).
        rewrites: One teacher reply per row, in order; a plain string is a reply that ended
            by itself, ``None`` a row whose prompt did not fit (``long_prompt``).
        keep_reasoning: The acceptance rule of ours for reasoning rows (see
            :func:`fallback_reason`); ``None``: off.

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
        reason = fallback_reason(text, row, reply.truncated, keep_reasoning)
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
