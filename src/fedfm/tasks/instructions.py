"""The instruction task's config and its rows.

Covers the source's split, held-out domains, the partition section, evaluation budgets and the
checks made when the task is built (:class:`fedfm.tasks.lm.InstructionTask` reads them).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import datasets
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedfm.data.prompt import PromptConfig
from fedfm.data.sources import SOURCES, load_source, source_info
from fedfm.errors import ConfigError
from fedfm.eval.llm import ROW_METRICS, ChoiceNorm, EvalSettings
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import TaskConfig

log = logging.getLogger("fedfm")

ZEROSHOT = "zeroshot/"
TEXT_NLL = "text_nll"
TEXT_TOP1 = "text_top1"  # share of a corpus's scored tokens that are the top-1 prediction
REF_NLL = "ref_nll"  # mean over items of the reference NLL per token (lower is better)
BUDGET_PERCENTILE = 90
"""A generation budget below this percentile of a domain's reference lengths is warned about."""


class TextNLLConfig(BaseModel):
    """Held-out general text scored by its NLL per token (``task.text_nll``).

    Attributes:
        corpus: A source of kind ``text`` (``c4_demo``: 300 C4 documents).
        docs: The first ``docs`` documents; ``None``: all.
        max_tokens: Tokens scored per document (its first ones; the first token itself has
            no prefix and is not counted).
    """

    model_config = ConfigDict(extra="forbid")

    corpus: str = "c4_demo"
    docs: int | None = Field(None, ge=1)
    max_tokens: int = Field(256, ge=2)


class InstructionConfig(TaskConfig):
    """Config of an instruction-tuning task (``task.kind: instruction``).

    Attributes:
        dataset: An instruction source (``instruct_suite``, ``alpaca_demo``, ``hf``, ...).
        source_options: Options of the source (e.g. ``per_domain_train``, ``domains``).
        model: A causal LM in the model registry (``smollm2-135m-instruct``, ``causal-lm``
            with ``model_args.name_or_path``, ``tiny-llama`` for tests).
        model_args: Arguments of the model builder (``vocab``, ``hidden`` for ``tiny-llama``).
        dtype: Dtype of the frozen base weights. ``bfloat16`` halves their memory; peft keeps
            the adapter in float32 either way.
        quantization: Load the frozen base quantised by bitsandbytes: ``4bit`` (QLoRA's NF4)
            or ``8bit``; needs CUDA and ``pip install 'fedfm[quant]'``. Adapters stay float32
            and travel as without it.
        autocast_bf16: Run forward passes (training and evaluation) under CPU/GPU bfloat16
            autocast: about 1.4x faster than float32 for SmolLM2 on a CPU with AVX512-BF16.
            On a GPU without bfloat16 (before Ampere), float16 autocast with a gradient
            scaler in local training; DP-SGD stays in float32 there. On a CPU without
            bfloat16 instructions none: there half precision is emulated and slower.
        lora: LoRA rank, scale, dropout and target modules.
        prompt: Chat formatting and length limits.
        test_fraction: Share of the training rows held out for the server when the source
            has no test split.
        local_test_fraction: Share of each client's rows kept for personalised evaluation
            (``algo.personal_eval``); 0 keeps all for training.
        max_train: Cap on training rows (a seeded random subset) before partitioning.
        max_eval: Held-out items evaluated (split evenly over domains); ``None``: all.
        max_new_tokens: Generation budget of each evaluated item.
        domain_max_new_tokens: Budgets of some domains replacing ``max_new_tokens`` (e.g.
            ``{math: 256}``: GSM8K solutions run to about 113 SmolLM2 tokens at the median).
        eval_batch_size: Prompts per generation/scoring batch.
        choice_mode: Classification items are answered by generation (``generate``: the reply
            must name the label) or by the most likely label (``loglik``).
        choice_norm: How ``loglik`` compares labels: ``none`` (summed log-likelihood of label
            and end-of-turn token, lm-evaluation-harness's ``acc``), ``bytes`` (divided by its
            UTF-8 bytes, ``acc_bytes``) or ``token_mean`` (per-token mean: biased towards
            multi-token labels; only to reproduce old figures).
        eval_ppl: Also report the perplexity of the reference responses (``ppl``), and keep
            each evaluated item's NLL.
        likelihood_only: Generate nothing at evaluation: classification items are scored by
            log-likelihood (needs ``choice_mode: loglik``), the others only by their
            reference's NLL (needs ``eval_ppl``).
        text_nll: Also score held-out general text by its NLL per token (``text_nll/<corpus>``)
            and its top-1 token accuracy (``text_top1/<corpus>``).
        train_domains: The only domains clients train on and that are scored as seen
            (``None``: every domain not held out).
        heldout_domains: Domains kept out of every client's data and evaluated zero-shot.
        heldout_domain: One held-out domain (the same as ``heldout_domains: [name]``).
        zeroshot_items: Test items evaluated per held-out domain; ``None``: as many as each
            seen domain gets from ``max_eval`` (all when ``max_eval`` is ``None``).
        primary: The run's headline metric: ``score`` (default), a metric kind (``acc``,
            ``bal_acc``, ``rougeL``, ``gsm8k_acc``), either with ``/<domain>``, or the same under
            ``zeroshot/`` for the held-out domains.
        bucket: Batch rows of similar length together (less padding).
        pad_to_multiple_of: Pad training batches to a multiple of this many tokens. Fewer
            distinct batch shapes mean fewer compiled kernels: bfloat16 matmuls on CPU keep
            one per shape, which in a simulation of many clients adds up (1: no rounding).
    """

    kind: Literal["instruction"] = "instruction"
    dataset: str = "instruct_suite"
    source_options: dict[str, Any] = Field(default_factory=dict)
    model: str = "smollm2-135m-instruct"
    model_args: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["float32", "bfloat16"] = "float32"
    quantization: Literal["4bit", "8bit"] | None = None
    autocast_bf16: bool = False
    lora: LoraConfigSpec = Field(default_factory=LoraConfigSpec)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    test_fraction: float = Field(0.1, gt=0, lt=1)
    local_test_fraction: float = Field(0.0, ge=0, lt=1)
    max_train: int | None = Field(None, ge=1)
    max_eval: int | None = Field(60, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    domain_max_new_tokens: dict[str, int] = Field(default_factory=dict)
    eval_batch_size: int = Field(16, ge=1)
    choice_mode: Literal["generate", "loglik"] = "generate"
    choice_norm: ChoiceNorm = "none"
    eval_ppl: bool = True
    likelihood_only: bool = False
    text_nll: TextNLLConfig | None = None
    train_domains: list[str] | None = None
    heldout_domains: list[str] = Field(default_factory=list)
    heldout_domain: str | None = None
    zeroshot_items: int | None = Field(None, ge=1)
    primary: str = "score"
    bucket: bool = True
    pad_to_multiple_of: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_heldout_list(self) -> InstructionConfig:
        if self.heldout_domain is not None:
            if self.heldout_domains and self.heldout_domains != [self.heldout_domain]:
                raise ValueError("set heldout_domains or heldout_domain, not both")
            self.heldout_domains = [self.heldout_domain]
        if len(set(self.heldout_domains)) != len(self.heldout_domains):
            raise ValueError(f"heldout_domains {self.heldout_domains} names a domain twice")
        bad = {d: n for d, n in self.domain_max_new_tokens.items() if n < 1}
        if bad:
            raise ValueError(f"domain_max_new_tokens must be >= 1, got {bad}")
        if self.likelihood_only and (self.choice_mode != "loglik" or not self.eval_ppl):
            raise ValueError(
                "likelihood_only generates nothing: it needs choice_mode: loglik and eval_ppl:"
                f" true (got {self.choice_mode!r} and {self.eval_ppl})"
            )
        return self

    def settings(self) -> EvalSettings:
        """The evaluation settings these fields make."""
        return EvalSettings(
            prompt=self.prompt,
            max_new_tokens=self.max_new_tokens,
            budgets=dict(self.domain_max_new_tokens),
            batch_size=self.eval_batch_size,
            choice_mode=self.choice_mode,
            choice_norm=self.choice_norm,
            with_ppl=self.eval_ppl,
            likelihood_only=self.likelihood_only,
        )


def split_rows(
    cfg: InstructionConfig, seed: int, train: datasets.Dataset, test: datasets.Dataset | None
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The source's train and test rows, at most ``max_train`` training rows.

    The split is seeded when the source has no test split.
    """
    if test is None:
        split = train.train_test_split(test_size=cfg.test_fraction, seed=seed)
        train, test = split["train"], split["test"]
    else:
        test = with_eval_columns(test)
    if cfg.max_train is not None and len(train) > cfg.max_train:
        train = train.shuffle(seed=seed).select(range(cfg.max_train))
    return train, test


def hold_out(
    cfg: InstructionConfig, train: datasets.Dataset, test: datasets.Dataset
) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset | None]:
    """``(train, test)`` of the training domains, and the held-out domains' test rows."""
    held, only = cfg.heldout_domains, cfg.train_domains
    if not held and only is None:
        return train, test, None
    domains = sorted(set(train["domain"]) | set(test["domain"]))
    for name, wanted in (("heldout_domains", held), ("train_domains", only or [])):
        unknown = [d for d in wanted if d not in domains]
        if unknown:
            raise ConfigError(f"task.{name}", f"{unknown} are not domains of the data ({domains})")
    both = sorted(set(held) & set(only or []))
    if both:
        raise ConfigError(
            "task.heldout_domains", f"{both} are also training domains (task.train_domains)"
        )
    seen = set(only) if only is not None else set(domains) - set(held)
    if not seen & set(train["domain"]):
        raise ConfigError("task.heldout_domains", "holding these out leaves no training data")
    zeroshot = rows_where(test, set(held)) if held else None
    if zeroshot is not None:
        empty = sorted(set(held) - set(zeroshot["domain"]))
        if empty:
            raise ConfigError("task.heldout_domains", f"no test items of {empty}")
    return rows_where(train, seen), rows_where(test, seen), zeroshot


def zeroshot_items(
    cfg: InstructionConfig, rows: datasets.Dataset, per_domain: int | None
) -> datasets.Dataset:
    """The first ``zeroshot_items`` (else ``per_domain``) test items of each held-out domain.

    Raises:
        ConfigError: A held-out domain has fewer test items than ``zeroshot_items``.
    """
    want = cfg.zeroshot_items
    if want is not None:
        have = domain_counts(rows)
        short = {d: n for d, n in have.items() if n < want}
        if short:
            raise ConfigError(
                "task.zeroshot_items",
                f"{want} items asked per held-out domain, but there are fewer test items ({short})",
            )
    return first_per_domain(rows, want if want is not None else per_domain)


def checked_primary(
    cfg: InstructionConfig, test: datasets.Dataset, heldout: datasets.Dataset | None
) -> str:
    """``task.primary``, once some evaluation of the task logs it.

    Raises:
        ConfigError: No evaluation logs it (field ``task.primary``).
    """
    name = cfg.primary
    zero = name.startswith(ZEROSHOT)
    rows = heldout if zero else test
    if rows is None:
        raise ConfigError("task.primary", f"'{name}' needs task.heldout_domains")
    # Likelihood only: the classification rows alone are scored.
    scored = [
        (m, d)
        for m, d in zip(rows["metric"], rows["domain"], strict=True)
        if m in ROW_METRICS and (m == "choice" or not cfg.likelihood_only)
    ]
    kinds = {ROW_METRICS.get(m).key for m, _ in scored} | ({"score"} if scored else set())
    if any(m == "choice" for m, _ in scored):
        kinds.add("bal_acc")  # mean balanced accuracy over the classification domains
    domains = {d for _, d in scored}
    if cfg.eval_ppl:  # every item's reference is scored by its NLL
        kinds.add(REF_NLL)
        domains |= set(rows["domain"])
    metric, _, domain = name.removeprefix(ZEROSHOT).partition("/")
    if metric not in kinds or (domain and domain not in domains):
        choices = sorted(kinds)
        raise ConfigError(
            "task.primary",
            f"'{name}' is not logged: use {'zeroshot/' if zero else ''}one of {choices},"
            f" optionally /<domain> of {sorted(domains)}",
        )
    return name


def warn_short_budgets(
    cfg: InstructionConfig,
    parts: list[datasets.Dataset],
    tokenizer: Any,
) -> dict[str, int]:
    """Warns about every generating domain whose budget is short of its reference lengths.

    A budget is short when below the 90th percentile of the domain's reference lengths (tokens of
    the reference and the end-of-turn token).

    Returns:
        That percentile per generating domain (the task keeps it in its stats).
    """
    settings = cfg.settings()
    lengths: dict[str, list[int]] = {}
    for part in parts:
        for out, domain, metric in zip(part["output"], part["domain"], part["metric"], strict=True):
            if settings.likelihood_only or (
                metric == "choice" and settings.choice_mode == "loglik"
            ):
                continue  # scored without generating
            ids = tokenizer(out, add_special_tokens=False)["input_ids"]
            lengths.setdefault(domain, []).append(len(ids) + 1)
    p90 = {d: int(np.ceil(np.percentile(v, BUDGET_PERCENTILE))) for d, v in lengths.items()}
    for domain, need in sorted(p90.items()):
        budget = settings.budget(domain)
        if budget < need:
            log.warning(
                "task.max_new_tokens: domain '%s' has %d new tokens, below the %dth"
                " percentile of its reference lengths (%d tokens): its answers will be cut"
                " (set task.domain_max_new_tokens.%s)",
                domain,
                budget,
                BUDGET_PERCENTILE,
                need,
                domain,
            )
    return p90


def partition_section(cfg: InstructionConfig, run: Any, train: datasets.Dataset) -> dict[str, Any]:
    """The run's ``partition`` section with the task's defaults: natural, by domain."""
    section = {"seed": run.seed, "by": "domain", **run.partition}
    section.setdefault("scheme", "natural")
    natural = section["scheme"] == "natural" and "num_clients" not in section
    if natural and section["by"] in train.column_names:  # one client per distinct value
        values = sorted(set(train[section["by"]]))
        if len(values) < 2:
            # A source without domains (every row "general") would silently become a
            # one-client federation.
            raise ConfigError(
                "partition.by",
                f"every training row has the same '{section['by']}' ({values[0]!r} in"
                f" '{cfg.dataset}'): a natural partition by it makes one client; set"
                " partition.scheme (e.g. iid) and partition.num_clients, or partition.by to a"
                " column with several values",
            )
        section["num_clients"] = len(values)
    return section


def per_domain_eval(cfg: InstructionConfig, test: datasets.Dataset) -> int | None:
    """Test items kept per domain under ``max_eval`` (all when ``None``)."""
    if cfg.max_eval is None:
        return None
    n_domains = max(len(set(test["domain"])), 1)
    return max(1, cfg.max_eval // n_domains)


def documents(cfg: TextNLLConfig) -> datasets.Dataset:
    """The first ``cfg.docs`` documents of the text source ``cfg.corpus``.

    Raises:
        ConfigError: The corpus is not a registered text source, or has fewer documents.
    """
    field = "task.text_nll"
    if cfg.corpus not in SOURCES:
        raise ConfigError(f"{field}.corpus", f"unknown source '{cfg.corpus}'")
    kind = source_info(cfg.corpus).kind
    if kind != "text":
        raise ConfigError(f"{field}.corpus", f"'{cfg.corpus}' is a {kind} set, not plain text")
    docs = load_source(cfg.corpus).train
    if cfg.docs is not None and cfg.docs > len(docs):
        raise ConfigError(f"{field}.docs", f"{cfg.docs} asked, '{cfg.corpus}' has {len(docs)}")
    return docs if cfg.docs is None else docs.select(range(cfg.docs))


def with_eval_columns(ds: datasets.Dataset) -> datasets.Dataset:
    """Adds ``domain`` (``general``) and ``metric`` (``rouge``) columns when a source lacks them."""
    if "domain" not in ds.column_names:
        ds = ds.add_column("domain", ["general"] * len(ds))
    if "metric" not in ds.column_names:
        ds = ds.add_column("metric", ["rouge"] * len(ds))
    return ds


def rows_where(ds: datasets.Dataset, domains: set[str]) -> datasets.Dataset:
    """Rows whose domain is one of ``domains``, in order."""
    return ds.select([i for i, d in enumerate(ds["domain"]) if d in domains])


def first_per_domain(ds: datasets.Dataset, k: int | None) -> datasets.Dataset:
    """The first ``k`` rows of each domain, in the dataset's order (all rows when ``k`` is None)."""
    if k is None:
        return ds
    seen: dict[str, int] = {}
    keep = []
    for i, domain in enumerate(ds["domain"]):
        if seen.get(domain, 0) < k:
            seen[domain] = seen.get(domain, 0) + 1
            keep.append(i)
    return ds.select(keep)


def domain_counts(ds: datasets.Dataset) -> dict[str, int]:
    """Number of rows of each domain of ``ds``."""
    domains, counts = np.unique(np.asarray(list(ds["domain"]), dtype=object), return_counts=True)
    return {str(d): int(c) for d, c in zip(domains, counts, strict=True)}
