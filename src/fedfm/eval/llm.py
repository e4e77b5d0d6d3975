"""Evaluators for instruction-tuned causal language models.

* :func:`lm_nll` — summed negative log-likelihood of the reference responses (response tokens and
  the end-of-turn token only, as in training) → :func:`fedfm.eval.metrics.perplexity`;
  :func:`reference_nlls` per row (paired comparisons of fidelity to the references).
* :func:`text_nlls` — NLL per token of plain documents (held-out general text, no template);
  :func:`text_scores` also the top-1 token accuracy from the same forward pass.
* :func:`multiple_choice_loglik` — picks the choice whose continuation (the label, then the
  end-of-turn token) is most likely after the prompt: the summed log-likelihood of the LM
  Evaluation Harness's ``acc`` (Gao et al., 2023), or divided by the continuation's UTF-8 byte
  length (its ``acc_bytes``; ``acc_norm`` divides by characters, the same for ASCII labels).
  Summing, not averaging per token: a per-token mean favours a label whose later tokens are
  near-certain once its first is chosen (TREC's ``ab|brev|iation``), whatever the question.
* :func:`evaluate_instructions` — per-row dispatch on the ``metric`` column of an instruction
  suite (``rouge`` / ``gsm8k`` / ``choice``), overall and per-domain means, with what shows a
  broken instrument beside them: each classification domain's predicted-label histogram and
  its majority-class and uniform baselines, its balanced accuracy and macro-F1
  (:func:`fedfm.eval.metrics.class_balanced_scores`, which a majority-class answer cannot
  win), and each domain's share of generations cut by the token budget;
  :func:`evaluate_instruction_items` also returns every item (prompt, reference, answer,
  score).
* :func:`head_to_head` — win rate of one model's items over another's.
* :func:`evaluate_held_out_domain` — zero-shot evaluation on one domain left out of training.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from fedfm.data.prompt import (
    IGNORE_INDEX,
    PromptConfig,
    collate,
    encode_example,
    end_of_turn_token,
    fit_prompt,
)
from fedfm.devices import model_device
from fedfm.errors import FedfmError
from fedfm.eval.metrics import (
    class_balanced_scores,
    gsm8k_correct,
    perplexity,
    pick_choice,
    resolve_answer,
    rouge_l,
)
from fedfm.models.generation import (
    Reply,
    eval_mode,
    generate_replies,
    pad_id_of,
    unwrap_bundle,
)
from fedfm.models.lm_loss import label_scores
from fedfm.registry import Registry

ChoiceNorm = Literal["none", "bytes", "token_mean"]
"""How a choice's summed log-likelihood is compared: ``none`` (the sum, the harness's ``acc``),
``bytes`` (divided by the continuation's UTF-8 bytes, ``acc_bytes``), ``token_mean`` (divided by
its token count: biased towards multi-token labels, kept only to reproduce old figures)."""
CHOICE_NORMS: tuple[str, ...] = ("none", "bytes", "token_mean")
NO_LABEL = "(none)"
"""The histogram bin of generations that name no label."""


def _token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probability of each label token given its prefix; 0 where the label is ``-100``.

    Returns:
        ``(batch, seq - 1)`` float32 tensor aligned with ``labels[:, 1:]``.
    """
    return _token_scores(model, batch)[0]


def _token_scores(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_token_logprobs`, and whether each label token is the model's top-1 prediction.

    Returns:
        ``(logprobs, hits)``, both ``(batch, seq - 1)`` aligned with ``labels[:, 1:]``; a hit
        is a label token that is the argmax of its position's logits (ties: the first index,
        as ``torch.argmax``), False where the label is ``-100``.
    """
    device = model_device(model)
    fast = label_scores(model, {k: v.to(device) for k, v in batch.items() if k in _FIELDS})
    if fast is not None:  # the head on the labelled positions only
        return fast
    logits, labels = _logits_labels(model, batch)
    hits = (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)
    return _picked(logits, labels), hits


_FIELDS = ("input_ids", "attention_mask", "labels")


def _logits_labels(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T-1, V)`` logits (position t predicts token t+1) and the ``(B, T-1)`` labels."""
    device = model_device(model)
    logits = model(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
    ).logits[:, :-1]
    return logits, batch["labels"][:, 1:].to(device)


def _picked(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, picked, torch.zeros_like(picked))


def _encoded_rows(tokenizer: Any, dataset: Any, prompt_cfg: PromptConfig) -> list[dict | None]:
    """The rows encoded for scoring.

    Encoded rows, in order; raw rows are encoded here (a loop, not ``Dataset.map``: no cache
    files or progress bars for an evaluation pass). A row with an empty reference is None.
    """
    if "labels" in dataset.column_names:
        return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in dataset]
    if "output" not in dataset.column_names or "instruction" not in dataset.column_names:
        raise FedfmError("lm_nll needs 'instruction' and 'output' columns (or encoded 'labels')")
    return [
        encode_example(tokenizer, r["instruction"], r.get("input") or "", r["output"], prompt_cfg)
        for r in dataset
    ]


def _scored_nlls(
    model: nn.Module, tokenizer: Any, rows: Sequence[dict | None], batch_size: int
) -> list[tuple[float, int] | None]:
    """Per encoded row (None: not scored), in order.

    The summed NLL of its ``labels`` tokens (those not ``-100``, each given its prefix) and their
    count.
    """
    got = _scored(model, tokenizer, rows, batch_size)
    return [None if r is None else (r[0], r[1]) for r in got]


def _scored(
    model: nn.Module, tokenizer: Any, rows: Sequence[dict | None], batch_size: int
) -> list[tuple[float, int, int] | None]:
    """:func:`_scored_nlls` with the count of label tokens that are the top-1 prediction."""
    kept = [(i, r) for i, r in enumerate(rows) if r is not None]
    kept.sort(key=lambda ir: len(ir[1]["input_ids"]))  # similar lengths together: less padding
    pad = pad_id_of(tokenizer)
    out: list[tuple[float, int, int] | None] = [None] * len(rows)
    with eval_mode(model), torch.inference_mode():
        for start in range(0, len(kept), batch_size):
            chunk = kept[start : start + batch_size]
            batch = collate([r for _, r in chunk], pad)
            logp, hits = _token_scores(model, batch)
            sums = logp.sum(-1, dtype=torch.float64)
            counts = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1)
            got = zip(chunk, sums.tolist(), counts.tolist(), hits.sum(-1).tolist(), strict=True)
            for (i, _), s, c, h in got:
                out[i] = (-float(s), int(c), int(h))
    return out


def reference_nlls(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    prompt_cfg: PromptConfig | None = None,
    batch_size: int = 8,
) -> list[tuple[float, int] | None]:
    """Per row of an instruction dataset, in order.

    The summed NLL (natural log) of its response tokens and the end-of-turn token (as in training)
    and their count; None for a row with an empty reference. Arguments as :func:`lm_nll`.
    """
    rows = _encoded_rows(tokenizer, dataset, prompt_cfg or PromptConfig())
    return _scored_nlls(model, tokenizer, rows, batch_size)


def lm_nll(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    prompt_cfg: PromptConfig | None = None,
    batch_size: int = 8,
) -> tuple[float, int]:
    """Summed NLL (natural log) and count of the response tokens of an instruction dataset.

    Args:
        model: Causal LM.
        tokenizer: Its tokenizer.
        dataset: Raw ``instruction, input, output`` rows (rows with an empty ``output`` are
            skipped, as in training) or rows already encoded (``labels``).
        prompt_cfg: Formatting and truncation, as in training.
        batch_size: Rows per forward pass.

    Returns:
        ``(nll_sum, n_tokens)``; ``perplexity(nll_sum, n_tokens)`` gives the perplexity.
    """
    per = [p for p in reference_nlls(model, tokenizer, dataset, prompt_cfg, batch_size) if p]
    return sum(p[0] for p in per), sum(p[1] for p in per)


def text_nlls(
    model: nn.Module, tokenizer: Any, texts: Sequence[str], max_tokens: int, batch_size: int = 8
) -> list[tuple[float, int, str]]:
    """Per plain document, in order.

    The summed NLL (natural log) of its first ``max_tokens`` tokens after the first, their count,
    and the scored text (:func:`text_scores` without the top-1 count).
    """
    got = text_scores(model, tokenizer, texts, max_tokens, batch_size)
    return [(g.nll, g.tokens, g.text) for g in got]


class TextScore(NamedTuple):
    """One plain document scored by :func:`text_scores`.

    Attributes:
        nll: Summed NLL (natural log) of its scored tokens.
        tokens: Their count (its first ``max_tokens`` tokens after the first).
        text: The scored text.
        top1: How many of the scored tokens are the model's top-1 prediction given their prefix
            (``top1 / tokens`` is the top-1 token accuracy).
    """

    nll: float
    tokens: int
    text: str
    top1: int


def text_scores(
    model: nn.Module, tokenizer: Any, texts: Sequence[str], max_tokens: int, batch_size: int = 8
) -> list[TextScore]:
    """Per plain document, in order: NLL, token count, scored text and top-1 hits.

    A document is read as a language model reads text in pretraining: no chat template and
    no special tokens; its first token has no prefix to be predicted from and is not counted
    (a document of one token scores ``(0.0, 0, text, 0)``). Top-1 token accuracy and NLL come
    from the same forward pass.
    """
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"])[:max_tokens] for t in texts]
    rows = [{"input_ids": x, "labels": x} for x in ids]
    scored = _scored(model, tokenizer, rows, batch_size)
    out = []
    for got, x in zip(scored, ids, strict=True):
        nll, n, hits = got if got is not None else (0.0, 0, 0)
        out.append(TextScore(nll, n, str(tokenizer.decode(x)), hits))
    return out


@dataclass(frozen=True)
class ChoiceScore:
    """One choice scored as the continuation of a prompt.

    Attributes:
        loglik: Summed natural-log likelihood of the continuation's tokens.
        tokens: Its token count (the end-of-turn token included when appended).
        text: The continuation as text (label, then the end-of-turn token's text when
            appended): what ``bytes`` normalisation measures.
    """

    loglik: float
    tokens: int
    text: str

    def value(self, norm: ChoiceNorm) -> float:
        """The score compared across choices under ``norm`` (see :data:`ChoiceNorm`)."""
        if norm == "none":
            return self.loglik
        if norm == "bytes":
            return self.loglik / max(len(self.text.encode("utf-8")), 1)
        if norm == "token_mean":
            return self.loglik / self.tokens
        raise FedfmError(f"choice norm must be one of {', '.join(CHOICE_NORMS)}, got {norm!r}")


def choice_logliks(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[int],
    choices: Sequence[str],
    batch_size: int = 16,
    prompt_cfg: PromptConfig | None = None,
    end_of_turn: bool = True,
) -> list[ChoiceScore]:
    """Summed log-likelihood of each choice as the continuation of ``prompt``.

    The continuation is the choice's tokens (tokenised on its own, ``add_special_tokens=False``)
    followed, with ``end_of_turn``, by the end-of-turn token that closes a reply in training: a
    label is scored as a whole answer, so ``"no"`` cannot win as the first word of
    ``"no change"``. Sequences ``prompt + continuation`` are scored in right-padded batches.
    """
    if not choices:
        raise FedfmError("multiple choice needs at least one choice")
    prompt_ids = (
        list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, str)
        else list(prompt)
    )
    end = end_of_turn_token(tokenizer, prompt_cfg) if end_of_turn else ""
    end_ids = [tokenizer.convert_tokens_to_ids(end)] if end else []
    rows = []
    for choice in choices:
        ids = list(tokenizer(choice, add_special_tokens=False)["input_ids"])
        if not ids:
            raise FedfmError(f"choice {choice!r} has no tokens")
        ids += end_ids
        rows.append(
            {"input_ids": prompt_ids + ids, "labels": [IGNORE_INDEX] * len(prompt_ids) + ids}
        )
    pad = pad_id_of(tokenizer)
    scores: list[ChoiceScore] = []
    with eval_mode(model), torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            lp = _token_logprobs(model, collate(chunk, pad)).sum(-1, dtype=torch.float64)
            scores += [
                ChoiceScore(float(s), len(r["input_ids"]) - len(prompt_ids), choice + end)
                for s, r, choice in zip(lp, chunk, choices[start : start + batch_size], strict=True)
            ]
    return scores


def multiple_choice_loglik(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[int],
    choices: Sequence[str],
    norm: ChoiceNorm = "none",
    batch_size: int = 16,
    prompt_cfg: PromptConfig | None = None,
) -> int:
    """Index of the choice whose continuation is most likely after ``prompt``.

    Args:
        model: Causal LM.
        tokenizer: Its tokenizer.
        prompt: Complete prompt string (see :func:`fedfm.data.prompt.format_prompt`) or its ids.
        choices: Candidate answers.
        norm: ``"none"`` (default) compares summed log-likelihoods of label + end-of-turn
            token; ``"bytes"`` divides them by the continuation's UTF-8 byte length;
            ``"token_mean"`` by its token count (see :data:`ChoiceNorm`).
        batch_size: Sequences per forward pass.
        prompt_cfg: Decides the end-of-turn token (chat template or not).

    Returns:
        Index into ``choices`` (the first on ties).
    """
    if norm not in CHOICE_NORMS:
        raise FedfmError(f"choice norm must be one of {', '.join(CHOICE_NORMS)}, got {norm!r}")
    scores = choice_logliks(model, tokenizer, prompt, choices, batch_size, prompt_cfg)
    return int(np.argmax([sc.value(norm) for sc in scores]))


@dataclass(frozen=True)
class RowMetric:
    """How one kind of suite row is scored.

    Attributes:
        key: Name of the metric in results (``rougeL``, ``gsm8k_acc``, ``acc``).
        score: ``(generation, row, finished) -> value in [0, 1]``; ``finished`` is False for a
            generation cut by its token budget.
    """

    key: str
    score: Callable[[str, dict, bool], float]


ROW_METRICS: Registry[RowMetric] = Registry("instruction metric", "metric")
"""Scorers selected by the ``metric`` column of an instruction suite."""


def _reference(row: Mapping[str, Any]) -> Any:
    # The suite's ``answer`` column holds the short gold answer; ``output`` is the fallback.
    answer = row.get("answer")
    return answer if answer not in (None, "") else row["output"]


def _named_choice(gen: str, row: dict) -> int | None:
    return pick_choice(gen, row["choices"])


ROW_METRICS.register("rouge", help="ROUGE-L F of the generation vs output")(
    RowMetric("rougeL", lambda gen, row, _: rouge_l(gen, row["output"]))
)
ROW_METRICS.register("gsm8k", help="final-number accuracy vs answer (0 when cut before it)")(
    RowMetric("gsm8k_acc", lambda gen, row, done: float(gsm8k_correct(gen, _reference(row), done)))
)
ROW_METRICS.register("choice", help="accuracy of the choice named by the generation")(
    RowMetric(
        "acc",
        lambda gen, row, _: float(
            _named_choice(gen, row) == resolve_answer(_reference(row), row["choices"])
        ),
    )
)


@dataclass(frozen=True)
class EvalSettings:
    """How an instruction suite is scored (the task's evaluation fields).

    Attributes:
        prompt: Prompt format and truncation (prompts are cut to ``max_prompt_length``).
        max_new_tokens: Generation budget of each item.
        budgets: Per-domain budgets replacing ``max_new_tokens`` for that domain.
        batch_size: Generation and scoring batch size.
        choice_mode: ``choice`` rows are answered by generation (``generate``: the reply must
            name the label) or by the most likely label (``loglik``).
        choice_norm: Normalisation of ``loglik`` choice scores (:data:`ChoiceNorm`).
        with_ppl: Also compute the perplexity of the reference outputs (and each item's NLL).
        likelihood_only: Generate nothing: ``choice`` rows are scored by log-likelihood
            (needs ``choice_mode="loglik"``), the other rows only by their reference's NLL
            (needs ``with_ppl``; they have no score).
    """

    prompt: PromptConfig = field(default_factory=PromptConfig)
    max_new_tokens: int = 64
    budgets: Mapping[str, int] | None = None
    batch_size: int = 8
    choice_mode: Literal["generate", "loglik"] = "generate"
    choice_norm: ChoiceNorm = "none"
    with_ppl: bool = False
    likelihood_only: bool = False

    def budget(self, domain: str) -> int:
        """The generation budget of ``domain``."""
        return int((self.budgets or {}).get(domain, self.max_new_tokens))


def evaluate_instructions(
    model: Any, tokenizer: Any, dataset: Any, settings: EvalSettings | None = None, **kw: Any
) -> dict[str, float]:
    """Scores a model on an instruction suite, overall and per domain.

    The means of :func:`evaluate_instruction_items`; ``kw`` are :class:`EvalSettings` fields.
    """
    return evaluate_instruction_items(model, tokenizer, dataset, settings, **kw)[0]


def evaluate_instruction_items(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    settings: EvalSettings | None = None,
    **kw: Any,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Scores a model on an instruction suite: the means and every item.

    Each row is scored by the metric its ``metric`` column names: ``rouge`` → ROUGE-L F of the
    greedy generation against ``output``; ``gsm8k`` → whether the generation's final number equals
    that of ``answer`` (``output`` when ``answer`` is empty; a generation cut by its budget
    before a ``####`` answer has no final number and scores 0: it is counted under
    ``truncated/<domain>``, not read for its last intermediate number); ``choice`` → whether
    the generation names the right choice (``choice_mode="generate"``) or the right choice's
    continuation is the most likely (``"loglik"``, compared under ``choice_norm``). With
    ``likelihood_only`` nothing is generated: rows of the generating metrics are not scored
    (their item's ``metric`` is ``nll``, its ``score`` None), only their reference's NLL.

    Args:
        model: Causal LM or ``LMBundle`` (then ``tokenizer`` may be ``None``).
        tokenizer: Its tokenizer.
        dataset: ``datasets.Dataset`` with ``instruction, output, metric`` and optionally
            ``input, domain, choices, answer`` columns (a missing ``domain`` counts as ``"all"``).
        settings: How to score (:class:`EvalSettings`); ``kw`` replaces some of its fields.
        **kw: :class:`EvalSettings` fields (``max_new_tokens=8, choice_mode="loglik"``).

    Returns:
        ``(metrics, items)``. ``metrics``: ``{key: mean}`` over all rows of each metric kind
        (``rougeL``, ``gsm8k_acc``, ``acc``), ``{key}/{domain}`` for each domain,
        ``score/{domain}`` (mean of the domain's row scores: its primary metric when, as in
        fedfm's suites, a domain uses one metric) and ``score`` (mean over domains of
        ``score/{domain}``, so every domain weighs the same), ``n`` and ``n/{domain}`` row
        counts; ``truncated/{domain}`` (share of the domain's generations that ran into the
        budget) and ``truncated`` (over every generation) where anything was generated; for
        each ``choice`` domain ``pred/{domain}/{label}`` (share of its items answered with
        each label, ``(none)`` for generations naming none), ``majority/{domain}`` (the
        accuracy of always answering the most frequent gold label) and ``uniform/{domain}``
        (the expected accuracy of a uniform guess, 1 / number of labels), ``bal_acc/{domain}``,
        ``f1_macro/{domain}`` and ``bal_acc_se/{domain}``
        (:func:`fedfm.eval.metrics.class_balanced_scores`), and ``bal_acc``, ``f1_macro``,
        ``bal_acc_se`` over the classification domains (each weighs the same); ``score_se``,
        the standard error of ``score`` (items independent).
        ``items``: one dict per row, in order, with ``id`` (the row's ``id``, else its
        index), ``domain``, ``metric`` (the key it counts towards), ``prompt``, ``reference``
        (what the answer was scored against), ``answer`` (the generation, or the picked
        choice under ``loglik``), ``label`` (the label answered, choice rows only),
        ``truncated`` and ``score`` in [0, 1] (None for a row not scored); with ``with_ppl``
        also ``nll`` and ``nll_tokens``, the summed NLL of the reference's tokens (and the
        end-of-turn token) and their count: what head-to-head win rates
        (:func:`head_to_head`), paired differences and distribution analyses need.
    """
    model, tokenizer = unwrap_bundle(model, tokenizer)
    cfg = replace(settings or EvalSettings(), **kw)
    if cfg.choice_norm not in CHOICE_NORMS:
        raise FedfmError(
            f"choice norm must be one of {', '.join(CHOICE_NORMS)}, got {cfg.choice_norm!r}"
        )
    if cfg.likelihood_only and (cfg.choice_mode != "loglik" or not cfg.with_ppl):
        raise FedfmError("likelihood_only needs choice_mode 'loglik' and with_ppl")
    rows = _suite_rows(dataset)
    fitted = [fit_prompt(tokenizer, r["instruction"], r["input"], cfg.prompt) for r in rows]
    prompts = [ids for _, ids in fitted]
    for r in rows:
        ROW_METRICS.get(r["metric"])  # unknown metric names fail before any generation

    by_loglik = {
        i for i, r in enumerate(rows) if r["metric"] == "choice" and cfg.choice_mode == "loglik"
    }
    others = [i for i in range(len(rows)) if i not in by_loglik]
    unscored = set(others) if cfg.likelihood_only else set()
    to_generate = [i for i in others if i not in unscored]
    replies = _generate_by_budget(model, tokenizer, rows, prompts, to_generate, cfg)
    values: list[tuple[str, str, float]] = []  # (domain, metric key, value)
    items: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        label: str | None = None
        score: float | None
        if i in unscored:
            key, answer, score = "nll", "", None
        elif i in replies:
            reply = replies[i]
            metric = ROW_METRICS.get(row["metric"])
            key, answer = metric.key, reply.text
            score = metric.score(reply.text, row, not reply.truncated)
            if row["metric"] == "choice":
                named = _named_choice(reply.text, row)
                label = NO_LABEL if named is None else row["choices"][named]
        else:
            pick = multiple_choice_loglik(
                model,
                tokenizer,
                prompts[i],
                row["choices"],
                cfg.choice_norm,
                cfg.batch_size,
                cfg.prompt,
            )
            gold = resolve_answer(_reference(row), row["choices"])
            key, answer, score = "acc", row["choices"][pick], float(pick == gold)
            label = answer
        if score is not None:
            values.append((row["domain"], key, score))
        reference = row["output"] if row["metric"] == "rouge" else _reference(row)
        items.append(
            {
                "id": row.get("id", i),
                "domain": row["domain"],
                "metric": key,
                "prompt": fitted[i][0],
                "reference": reference,
                "answer": answer,
                **({"label": label} if label is not None else {}),
                "truncated": bool(i in replies and replies[i].truncated),
                "score": score,
            }
        )
    results = _aggregate(values) if values else {}
    results.update(instrument_readouts(rows, items, set(replies)))
    if cfg.with_ppl:
        ppl, nlls = _perplexities(model, tokenizer, dataset, rows, cfg.prompt, cfg.batch_size)
        results.update(ppl)
        for item, got in zip(items, nlls, strict=True):
            if got is not None:
                item.update(nll=got[0], nll_tokens=got[1], ref_nll=got[0] / got[1])
        results.update(reference_nll_means(items))
    return results, items


def reference_nll_means(items: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``ref_nll``: the mean over items of each reference's NLL per token.

    With its standard error ``ref_nll_se`` and ``ref_nll/<domain>``. Each item weighs the
    same (``ppl`` weighs each token), so that two evaluations of the same items compare item
    by item.
    """
    per: dict[str, list[float]] = {}
    for it in items:
        if it.get("ref_nll") is not None:
            per.setdefault(str(it["domain"]), []).append(float(it["ref_nll"]))
    values = [v for vs in per.values() for v in vs]
    if not values:
        return {}
    out = {f"ref_nll/{d}": float(np.mean(vs)) for d, vs in sorted(per.items())}
    out["ref_nll"] = float(np.mean(values))
    se = float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else math.nan
    out["ref_nll_se"] = se
    return out


def _generate_by_budget(
    model: nn.Module,
    tokenizer: Any,
    rows: list[dict],
    prompts: list[list[int]],
    todo: list[int],
    cfg: EvalSettings,
) -> dict[int, Reply]:
    """Greedy replies of rows ``todo``, each domain with its own budget (one pass per budget)."""
    out: dict[int, Reply] = {}
    by_budget: dict[int, list[int]] = defaultdict(list)
    for i in todo:
        by_budget[cfg.budget(rows[i]["domain"])].append(i)
    for budget, idx in sorted(by_budget.items()):
        got = generate_replies(
            model, tokenizer, [prompts[i] for i in idx], budget, cfg.batch_size, cfg.prompt
        )
        out.update(zip(idx, got, strict=True))
    return out


def instrument_readouts(
    rows: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]], generated: set[int]
) -> dict[str, float]:
    """What shows a broken instrument (DESIGN.md principle 15), from scored items.

    Returns:
        ``truncated/<domain>`` and ``truncated`` over the generated items (row indices in
        ``generated``); per ``choice`` domain ``pred/<domain>/<label>``, ``majority/<domain>``,
        ``uniform/<domain>``, ``bal_acc/<domain>``, ``f1_macro/<domain>`` and
        ``bal_acc_se/<domain>``, and their means over those domains (see
        :func:`evaluate_instruction_items`).
    """
    out: dict[str, float] = {}
    cut: dict[str, list[bool]] = defaultdict(list)
    for i in sorted(generated):
        cut[str(items[i]["domain"])].append(bool(items[i]["truncated"]))
    for domain, flags in sorted(cut.items()):
        out[f"truncated/{domain}"] = float(np.mean(flags))
    if cut:
        out["truncated"] = float(np.mean([f for flags in cut.values() for f in flags]))
    by_domain: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row["metric"] == "choice":
            by_domain[str(row["domain"])].append(i)
    for domain, idx in sorted(by_domain.items()):
        # Labels by text: rows of one domain may list their choices in different orders.
        labels = list(dict.fromkeys(str(c) for i in idx for c in rows[i]["choices"]))
        answered = [str(items[i].get("label")) for i in idx]
        gold = Counter(
            str(rows[i]["choices"][resolve_answer(_reference(rows[i]), rows[i]["choices"])])
            for i in idx
        )
        for label in labels + ([NO_LABEL] if NO_LABEL in answered else []):
            out[f"pred/{domain}/{label}"] = answered.count(label) / len(idx)
        out[f"majority/{domain}"] = max(gold.values()) / len(idx)
        out[f"uniform/{domain}"] = 1.0 / len(labels)
        golds = [
            str(rows[i]["choices"][resolve_answer(_reference(rows[i]), rows[i]["choices"])])
            for i in idx
        ]
        for key, value in class_balanced_scores(golds, answered).items():
            out[f"{key}/{domain}"] = value
    if by_domain:  # every classification domain weighs the same, as in ``score``
        names = sorted(by_domain)
        for key in ("bal_acc", "f1_macro"):
            out[key] = float(np.mean([out[f"{key}/{d}"] for d in names]))
        out["bal_acc_se"] = float(np.sqrt(sum(out[f"bal_acc_se/{d}"] ** 2 for d in names)))
        out["bal_acc_se"] /= len(names)
    return out


def head_to_head(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], tie: float = 0.0
) -> dict[str, float]:
    """Win rate of evaluation ``a`` over ``b`` on the items both scored.

    Win rate of evaluation ``a`` over ``b`` on the items both scored (matched by ``id``;
    items without a score, e.g. those scored by likelihood only, are left out).

    An item is a win when ``a``'s score exceeds ``b``'s by more than ``tie``, a loss in the
    opposite case and a tie otherwise; ``win_rate = (wins + ties / 2) / n``, so two equal
    models score 0.5.

    Args:
        a: Items of :func:`evaluate_instruction_items` for the first model.
        b: Items for the second model.
        tie: Score differences up to this count as ties.

    Returns:
        ``wins``, ``ties``, ``losses``, ``n``, ``win_rate`` overall and ``win_rate/<domain>``.

    Raises:
        FedfmError: The two evaluations share no item.
    """
    scores_b = {item["id"]: item["score"] for item in b if item.get("score") is not None}
    outcome: dict[str, list[float]] = defaultdict(list)  # domain -> 1 win, 0.5 tie, 0 loss
    for item in a:
        if item["id"] in scores_b and item.get("score") is not None:
            diff = float(item["score"]) - float(scores_b[item["id"]])
            outcome[item["domain"]].append(1.0 if diff > tie else 0.0 if diff < -tie else 0.5)
    every = [v for values in outcome.values() for v in values]
    if not every:
        raise FedfmError("head_to_head: the two evaluations share no item id")
    out = {
        "wins": float(every.count(1.0)),
        "ties": float(every.count(0.5)),
        "losses": float(every.count(0.0)),
        "n": float(len(every)),
        "win_rate": float(np.mean(every)),
    }
    out.update({f"win_rate/{d}": float(np.mean(v)) for d, v in sorted(outcome.items())})
    return out


def _suite_rows(dataset: Any) -> list[dict]:
    columns = set(dataset.column_names)
    missing = {"instruction", "output", "metric"} - columns
    if missing:
        raise FedfmError(f"instruction suite lacks column(s) {sorted(missing)}")
    if len(dataset) == 0:
        raise FedfmError("instruction suite is empty")
    rows = []
    for r in dataset:
        row = dict(r)
        row["input"] = row.get("input") or ""
        row["domain"] = row.get("domain") or "all"
        if row["metric"] == "choice" and not row.get("choices"):
            raise FedfmError(f"choice row {row.get('id', '?')!r} has no choices")
        rows.append(row)
    return rows


def _aggregate(values: list[tuple[str, str, float]]) -> dict[str, float]:
    by_key: dict[str, list[float]] = defaultdict(list)
    by_domain: dict[str, list[float]] = defaultdict(list)
    for domain, key, value in values:
        by_key[key].append(value)
        by_key[f"{key}/{domain}"].append(value)
        by_domain[domain].append(value)
    results = {k: float(np.mean(v)) for k, v in sorted(by_key.items())}
    for domain, vals in sorted(by_domain.items()):
        results[f"score/{domain}"] = float(np.mean(vals))
        results[f"n/{domain}"] = float(len(vals))
    results["score"] = float(np.mean([results[f"score/{d}"] for d in by_domain]))
    # The standard error of that mean of domain means (items independent; ours).
    var = [np.var(v, ddof=1) / len(v) if len(v) > 1 else 0.0 for v in by_domain.values()]
    results["score_se"] = float(np.sqrt(sum(var))) / len(by_domain)
    results["n"] = float(len(values))
    return results


def _perplexities(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    rows: list[dict],
    prompt_cfg: PromptConfig,
    batch_size: int,
) -> tuple[dict[str, float], list[tuple[float, int] | None]]:
    """``ppl/<domain>`` and ``ppl`` of the references, and each row's ``(NLL, tokens)``."""
    out: dict[str, float] = {}
    per: list[tuple[float, int] | None] = [None] * len(rows)
    totals = [0.0, 0]
    for domain in sorted({r["domain"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["domain"] == domain]
        got = reference_nlls(model, tokenizer, dataset.select(idx), prompt_cfg, batch_size)
        for i, g in zip(idx, got, strict=True):
            per[i] = g
        nll, n = sum(g[0] for g in got if g), sum(g[1] for g in got if g)
        if n:
            out[f"ppl/{domain}"] = perplexity(nll, n)
        totals[0] += nll
        totals[1] += n
    if totals[1]:
        out["ppl"] = perplexity(totals[0], int(totals[1]))
    return out, per


def split_held_out_domain(dataset: Any, domain: str) -> tuple[Any, Any]:
    """``(seen, held_out)``: rows of every other domain and rows of ``domain``.

    Train (federate) on ``seen`` and pass ``held_out`` to :func:`evaluate_instructions`, or call
    :func:`evaluate_held_out_domain`, for zero-shot transfer to an unseen domain.

    Raises:
        FedfmError: The dataset has no ``domain`` column or no row of ``domain``.
    """
    if "domain" not in dataset.column_names:
        raise FedfmError("dataset has no 'domain' column to hold a domain out")
    domains = dataset["domain"]
    held = [i for i, d in enumerate(domains) if d == domain]
    if not held:
        raise FedfmError(f"domain {domain!r} not in dataset (domains: {sorted(set(domains))})")
    held_set = set(held)
    seen = [i for i in range(len(domains)) if i not in held_set]
    return dataset.select(seen), dataset.select(held)


def evaluate_held_out_domain(
    model: Any, tokenizer: Any, dataset: Any, domain: str, **kwargs: Any
) -> dict[str, float]:
    """Zero-shot score on one domain: :func:`evaluate_instructions` on that domain's rows only.

    The model is assumed to have been trained without ``domain`` (see
    :func:`split_held_out_domain`); ``kwargs`` go to :func:`evaluate_instructions`.
    """
    _, held_out = split_held_out_domain(dataset, domain)
    return evaluate_instructions(model, tokenizer, held_out, **kwargs)
