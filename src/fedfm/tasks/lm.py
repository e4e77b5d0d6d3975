"""Instruction tuning of a causal LM with LoRA: the task behind FedIT and the quickstart.

FedIT (Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning",
ICASSP 2024) is FedAvg over LoRA adapters (Hu et al., ICLR 2022) of a frozen LLM, each client
holding instructions of its own kind. Here that is the ordinary FedAvg family of
:mod:`fedfm.algorithms.fedavg` run on this task: the model the task builds is the foundation
model's adapter :data:`ADAPTER`, and what of it travels (:meth:`InstructionTask.get_params`, so
every message, client state and checkpoint) is that adapter read through the handle
(:meth:`fedfm.fm.FoundationModel.get_adapter`), in peft's saved keys like every LLM algorithm's.

Data: any ``instruction`` source (default the offline multi-domain ``instruct_suite``; ``hf``
for Alpaca/Dolly files or hub ids), split over clients by domain (``natural``, the default) or by
any scheme of :mod:`fedfm.data.partition` (e.g. Dirichlet over ``domain``). Prompts use the
model's chat template with the loss on response tokens only (:mod:`fedfm.data.prompt`).
Evaluation is :func:`fedfm.eval.llm.evaluate_instructions` on held-out items: each domain is
scored by its own metric (ROUGE-L, GSM8K final-number accuracy, label accuracy) and the headline
``score`` is the mean over domains of each domain's score, so every domain weighs the same.
Any set of domains can be held out of training entirely (``heldout_domains``, with their own
item count ``zeroshot_items``): they are scored per item like the rest and reported as
``zeroshot/...`` (``zeroshot/score`` can be the run's primary metric). Held-out general text
(``text_nll``: plain documents such as C4's) is scored by its NLL per token, and
``likelihood_only`` scores without generating anything (labels by log-likelihood, the other
items by their reference's NLL, kept per item). Beside the scores, each
classification domain logs its predicted-label histogram with the majority-class and uniform
baselines, and each domain the share of generations cut by its token budget
(:func:`fedfm.eval.llm.instrument_readouts`); a budget below the 90th percentile of a domain's
reference lengths is warned about when the task is built.

Memory: the frozen base model is loaded once per process (keyed by name, dtype and arguments)
and shared by every simulated client; :meth:`InstructionTask.build_model` returns the handle's
one ``PeftModel`` around it, so N simulated clients cost one model plus N adapters' worth of
state.

Choices of ours (not from a paper): held-out evaluation items are the first
``max_eval // domains`` test items of each domain (the suite draws them at random already), so
every domain is represented, and as many of each zero-shot domain unless ``zeroshot_items``
says otherwise; batches group rows of similar length (``bucket``, like
``group_by_length`` in transformers' Trainer) to waste less compute on padding; sources without
a ``metric`` column are scored with ROUGE-L.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from fedfm.config import validate_section
from fedfm.core.seeding import derive_seed
from fedfm.data.partition import PartitionConfig, partition, partition_stats
from fedfm.data.prompt import InstructionBatches, PromptConfig
from fedfm.data.sources import SOURCES, load_source, source_info
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError, FedfmError
from fedfm.eval.llm import (
    ROW_METRICS,
    ChoiceNorm,
    EvalSettings,
    evaluate_instruction_items,
    text_nlls,
)
from fedfm.fm import FoundationModel
from fedfm.models.causal_lm import LMBundle, check_lm_setup
from fedfm.models.generation import pad_id_of
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import FOUNDATION_MODEL, ITEM_RESULTS, TASKS, Task, TaskConfig

log = logging.getLogger("fedfm")

ZEROSHOT = "zeroshot/"
TEXT_NLL = "text_nll"
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
        text_nll: Also score held-out general text by its NLL per token (``text_nll/<corpus>``).
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


@dataclass
class InstructionData:
    """Instruction rows of one client (or of the server's held-out set).

    Attributes:
        rows: Columns ``id, instruction, input, output, domain, metric`` (and, for the suite,
            ``choices, answer``).
        heldout: Rows of the zero-shot domains (server test data only), else ``None``.
        documents: Plain documents of ``task.text_nll`` (``id``, ``text``; server test data
            only), else ``None``.
        encoded: Token ids, masks and response-only labels, filled on first use and kept, so
            each client's data is tokenised once per process.
    """

    rows: datasets.Dataset
    heldout: datasets.Dataset | None = None
    documents: datasets.Dataset | None = None
    encoded: list[dict[str, list[int]]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def ids(self) -> list[int]:
        """The row ids, in order.

        Raises:
            FedfmError: The rows have no ``id`` column.
        """
        if "id" not in self.rows.column_names:
            raise FedfmError("these instruction rows have no 'id' column")
        return [int(i) for i in self.rows["id"]]

    def subset(self, ids: Iterable[int | str]) -> InstructionData:
        """The rows whose ``id`` is in ``ids``, in this data's order (coresets, selections).

        Ids may be given as ints or as their strings (as JSON client state keeps them).

        Raises:
            FedfmError: An id is not a row of this data.
        """
        wanted = {str(i) for i in ids}
        have = [str(i) for i in self.ids()]
        missing = sorted(wanted - set(have))
        if missing:
            raise FedfmError(f"ids {missing[:5]} are not rows of this data ({len(have)} rows)")
        return InstructionData(self.rows.select([k for k, i in enumerate(have) if i in wanted]))

    def with_outputs(self, outputs: Mapping[int | str, str]) -> InstructionData:
        """A copy whose rows named in ``outputs`` (by id) answer with the given text.

        The answers the rows had before go to an ``output_raw`` column (kept as is when the
        data was already rewritten, so it always holds the source's answers); rows not named
        keep their output. The copy is re-encoded on first use. This is FedSD's distilled set
        (rewritten answers) next to the raw one.

        Raises:
            FedfmError: An id is not a row of this data.
        """
        new = {str(k): str(v) for k, v in outputs.items()}
        ids = [str(i) for i in self.ids()]
        missing = sorted(set(new) - set(ids))
        if missing:
            raise FedfmError(f"ids {missing[:5]} are not rows of this data ({len(ids)} rows)")
        rows = self.rows
        if "output_raw" not in rows.column_names:
            rows = rows.add_column("output_raw", list(rows["output"]))
        replaced = [new.get(i, out) for i, out in zip(ids, rows["output"], strict=True)]
        rows = rows.remove_columns("output").add_column("output", replaced)
        return InstructionData(rows)


# ---------------------------------------------------------------------------------------------
# The shared frozen base and the PeftModel around it live in fedfm.fm, one of each per process.

ADAPTER = "default"
"""The adapter the task's model trains (FedIT's): peft's default name, so the exported
adapter sits at the top of its folder."""


def foundation_model_for(
    cfg: InstructionConfig, device: torch.device | None = None
) -> FoundationModel:
    """The handle on the task's model: its base, dtype, LoRA and prompt settings, autocast,
    on ``device`` (the CPU when ``None``)."""
    return FoundationModel(
        cfg.model,
        cfg.dtype,
        cfg.model_args,
        lora=cfg.lora,
        prompt=cfg.prompt,
        autocast_bf16=cfg.autocast_bf16,
        quantization=cfg.quantization,
        device=device,
    )


# ---------------------------------------------------------------------------------------------


class InstructionTask(Task):
    """Federated instruction tuning of a causal LM with LoRA adapters (see the module doc)."""

    Config = InstructionConfig
    kind = "lm"
    primary = "score"
    higher_is_better = True

    def __init__(self, cfg: InstructionConfig, run: Any) -> None:
        super().__init__(cfg, run)
        self.cfg: InstructionConfig = cfg
        self._fm: FoundationModel | None = None
        src = load_source(cfg.dataset, **cfg.source_options)
        if src.info.kind != "instruction":
            raise ConfigError(
                "task.dataset", f"'{cfg.dataset}' is a {src.info.kind} set, not instructions"
            )
        train, test = self._split(_with_eval_columns(src.train), src.test)
        train, test, zeroshot = self._hold_out(train, test)
        self.pcfg = validate_section(PartitionConfig, self._partition_section(train), "partition")
        parts = partition(train, self.pcfg)
        self._stats = partition_stats(parts, "domain")
        self._clients: dict[str, InstructionData] = {}
        self._local_test: dict[str, InstructionData] = {}
        for i, part in enumerate(parts):
            n_test = round(cfg.local_test_fraction * len(part))
            perm = np.random.default_rng(derive_seed(run.seed, "local-test", i)).permutation(
                len(part)
            )
            self._local_test[str(i)] = InstructionData(part.select(np.sort(perm[:n_test])))
            self._clients[str(i)] = InstructionData(part.select(np.sort(perm[n_test:])))
        per_domain = self._per_domain_eval(test)
        self._test = InstructionData(
            _first_per_domain(test, per_domain),
            self._zeroshot_items(zeroshot, per_domain) if zeroshot is not None else None,
            _documents(cfg.text_nll) if cfg.text_nll is not None else None,
        )
        self._check_primary()
        self._budget_p90 = self._warn_short_budgets()

    # ----- construction helpers -----
    def _split(
        self, train: datasets.Dataset, test: datasets.Dataset | None
    ) -> tuple[datasets.Dataset, datasets.Dataset]:
        if test is None:
            split = train.train_test_split(test_size=self.cfg.test_fraction, seed=self.run.seed)
            train, test = split["train"], split["test"]
        else:
            test = _with_eval_columns(test)
        if self.cfg.max_train is not None and len(train) > self.cfg.max_train:
            train = train.shuffle(seed=self.run.seed).select(range(self.cfg.max_train))
        return train, test

    def _hold_out(
        self, train: datasets.Dataset, test: datasets.Dataset
    ) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset | None]:
        """``(train, test)`` of the training domains, and the held-out domains' test rows."""
        held, only = self.cfg.heldout_domains, self.cfg.train_domains
        if not held and only is None:
            return train, test, None
        domains = sorted(set(train["domain"]) | set(test["domain"]))
        for name, wanted in (("heldout_domains", held), ("train_domains", only or [])):
            unknown = [d for d in wanted if d not in domains]
            if unknown:
                raise ConfigError(
                    f"task.{name}", f"{unknown} are not domains of the data ({domains})"
                )
        both = sorted(set(held) & set(only or []))
        if both:
            raise ConfigError(
                "task.heldout_domains", f"{both} are also training domains (task.train_domains)"
            )
        seen = set(only) if only is not None else set(domains) - set(held)
        if not seen & set(train["domain"]):
            raise ConfigError("task.heldout_domains", "holding these out leaves no training data")
        zeroshot = _rows_where(test, set(held)) if held else None
        if zeroshot is not None:
            empty = sorted(set(held) - set(zeroshot["domain"]))
            if empty:
                raise ConfigError("task.heldout_domains", f"no test items of {empty}")
        return _rows_where(train, seen), _rows_where(test, seen), zeroshot

    def _zeroshot_items(self, rows: datasets.Dataset, per_domain: int | None) -> datasets.Dataset:
        """The first ``zeroshot_items`` (else ``per_domain``) test items of each held-out domain.

        Raises:
            ConfigError: A held-out domain has fewer test items than ``zeroshot_items``.
        """
        want = self.cfg.zeroshot_items
        if want is not None:
            have = _domain_counts(rows)
            short = {d: n for d, n in have.items() if n < want}
            if short:
                raise ConfigError(
                    "task.zeroshot_items",
                    f"{want} items asked per held-out domain, but there are fewer test items"
                    f" ({short})",
                )
        return _first_per_domain(rows, want if want is not None else per_domain)

    def _check_primary(self) -> None:
        """Refuses a primary metric no evaluation of this task logs (field ``task.primary``)."""
        name = self.cfg.primary
        zero = name.startswith(ZEROSHOT)
        rows = self._test.heldout if zero else self._test.rows
        if rows is None:
            raise ConfigError("task.primary", f"'{name}' needs task.heldout_domains")
        # Likelihood only: the classification rows alone are scored.
        scored = [
            (m, d)
            for m, d in zip(rows["metric"], rows["domain"], strict=True)
            if m in ROW_METRICS and (m == "choice" or not self.cfg.likelihood_only)
        ]
        kinds = {ROW_METRICS.get(m).key for m, _ in scored} | ({"score"} if scored else set())
        if any(m == "choice" for m, _ in scored):
            kinds.add("bal_acc")  # mean balanced accuracy over the classification domains
        metric, _, domain = name.removeprefix(ZEROSHOT).partition("/")
        domains = {d for _, d in scored}
        if metric not in kinds or (domain and domain not in domains):
            choices = sorted(kinds)
            raise ConfigError(
                "task.primary",
                f"'{name}' is not logged: use {'zeroshot/' if zero else ''}one of {choices},"
                f" optionally /<domain> of {sorted(domains)}",
            )
        self.primary = name

    def _warn_short_budgets(self) -> dict[str, int]:
        """Warns about every generating domain whose budget is below the 90th percentile of its
        reference lengths (tokens of the reference and the end-of-turn token).

        Returns:
            That percentile per generating domain (kept in :meth:`stats`).
        """
        rows = [self._test.rows, *([self._test.heldout] if self._test.heldout else [])]
        settings = self.cfg.settings()
        lengths: dict[str, list[int]] = {}
        for part in rows:
            for out, domain, metric in zip(
                part["output"], part["domain"], part["metric"], strict=True
            ):
                if settings.likelihood_only or (
                    metric == "choice" and settings.choice_mode == "loglik"
                ):
                    continue  # scored without generating
                ids = self.tokenizer(out, add_special_tokens=False)["input_ids"]
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

    def _partition_section(self, train: datasets.Dataset) -> dict[str, Any]:
        section = {"seed": self.run.seed, "by": "domain", **self.run.partition}
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
                    f" '{self.cfg.dataset}'): a natural partition by it makes one client; set"
                    " partition.scheme (e.g. iid) and partition.num_clients, or partition.by to a"
                    " column with several values",
                )
            section["num_clients"] = len(values)
        return section

    def _per_domain_eval(self, test: datasets.Dataset) -> int | None:
        if self.cfg.max_eval is None:
            return None
        n_domains = max(len(set(test["domain"])), 1)
        return max(1, self.cfg.max_eval // n_domains)

    # ----- the shared model -----
    @classmethod
    def check_run(cls, cfg: TaskConfig, run: Any) -> None:
        assert isinstance(cfg, InstructionConfig)
        check_lm_setup(cfg.model, cfg.model_args, cfg.lora, cfg.quantization, run.device)

    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        return frozenset({FOUNDATION_MODEL, ITEM_RESULTS})

    def foundation_model(self) -> FoundationModel:
        """The handle on the shared base and its adapters that LLM algorithms use."""
        if self._fm is None:
            self._fm = foundation_model_for(self.cfg, self.device)
        return self._fm

    @property
    def bundle(self) -> LMBundle:
        """The shared frozen base model and its tokenizer (loaded on first use)."""
        return self.foundation_model().bundle

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.bundle.tokenizer

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast when ``autocast_bf16`` is set (see :meth:`FoundationModel.autocast`), else a
        no-op context."""
        return self.foundation_model().autocast()

    # ----- Task API -----
    def client_ids(self) -> list[str]:
        return list(self._clients)

    def client_data(self, cid: str) -> InstructionData:
        return self._clients[cid]

    def client_test_data(self, cid: str) -> InstructionData:
        return self._local_test[cid]

    def test_data(self) -> InstructionData:
        return self._test

    def num_examples(self, data: InstructionData) -> int:
        return len(data)

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """The handle's shared ``PeftModel`` with adapter :data:`ADAPTER` freshly initialised
        (the only active and trainable one; other adapters keep their tensors).

        Args:
            seed: Seeds the adapter's ``A`` matrices (``B`` starts at zero: the model equals
                the base until trained).
            **overrides: ``lora`` (a dict of :class:`LoraConfigSpec` fields replacing the
                task's).

        Returns:
            The process-wide model: a second call re-initialises what the first returned;
            callers that need several live adapters use :meth:`foundation_model`.
        """
        unknown = set(overrides) - {"lora"}
        if unknown:
            raise ConfigError("task.model_args", f"unknown model overrides {sorted(unknown)}")
        spec = self.cfg.lora
        if overrides.get("lora"):
            spec = LoraConfigSpec.model_validate({**spec.model_dump(), **overrides["lora"]})
        fm = self.foundation_model()
        fm.reset_adapter(ADAPTER, seed, spec)
        fm.set_active([ADAPTER], [ADAPTER])
        return fm.model

    def get_params(self, model: nn.Module, names: list[str] | None = None) -> dict[str, Tensor]:
        """Adapter :data:`ADAPTER` of the model (:meth:`build_model`'s), through the handle:
        peft's saved keys, the adapter not named."""
        state = self._handle_of(model).get_adapter(ADAPTER)
        return state if names is None else {k: state[k] for k in names}

    def set_params(self, model: nn.Module, params: Mapping[str, Tensor]) -> None:
        """Puts ``params`` (every tensor of an adapter of this shape) into :data:`ADAPTER`."""
        self._handle_of(model).set_adapter(ADAPTER, params)

    def param_names(self, model: nn.Module) -> dict[str, str]:
        return self._handle_of(model).param_names(ADAPTER)

    def save_adapter(self, model: nn.Module, folder: Path) -> bool:
        """Writes :data:`ADAPTER` in peft's format into ``folder``."""
        self._handle_of(model).save_adapter(ADAPTER, folder)
        return True

    def _handle_of(self, model: nn.Module) -> FoundationModel:
        """The handle whose shared model ``model`` is; any other model is refused, since its
        adapter would not be the one read or written."""
        fm = self.foundation_model()
        if model is not fm.model:
            raise FedfmError(f"{type(model).__name__} is not this task's model (build_model's)")
        return fm

    def encode(self, data: InstructionData) -> list[dict[str, list[int]]]:
        """Token ids, attention masks and response-only labels of ``data`` (cached on it), by
        the foundation model's one row encoder (:meth:`FoundationModel.encode`)."""
        if data.encoded is None:
            # Columns rather than Dataset.map: no cache files or progress bars per client.
            rows = data.rows
            inputs = rows["input"] if "input" in rows.column_names else [""] * len(rows)
            data.encoded = self.foundation_model().encode(
                {"instruction": inst, "input": inp, "output": out}
                for inst, inp, out in zip(rows["instruction"], inputs, rows["output"], strict=True)
            )
        return data.encoded

    def batches(self, data: InstructionData, batch_size: int, seed: int) -> Iterator[Any]:
        """Endless seeded batches ``{input_ids, attention_mask, labels}``, each ``[B, T]``."""
        rows = self.encode(data)
        if not rows:
            raise ValueError("cannot draw batches from an empty client dataset")
        epochs = InstructionBatches(
            rows,
            batch_size,
            pad_id_of(self.tokenizer),
            seed=seed,
            bucket=self.cfg.bucket,
            pad_multiple=self.cfg.pad_to_multiple_of,
        )
        while True:
            yield from epochs  # each pass is the next epoch, reshuffled

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
        """Mean cross-entropy over response tokens (labels are -100 elsewhere)."""
        with self.autocast():
            out = model(**to_device(batch, model_device(model)))
        return out.loss, out

    def evaluate(self, model: nn.Module, data: InstructionData) -> dict[str, float]:
        """Per-domain and overall metrics on ``data``; ``zeroshot/...`` for held-out domains.

        Returns:
            ``score`` (mean over domains), ``score/<domain>``, each metric kind overall and
            per domain (``rougeL``, ``gsm8k_acc``, ``acc``), ``ppl`` when ``eval_ppl``, counts
            ``n``, the instrument readouts (``truncated/<domain>``, ``pred/<domain>/<label>``,
            ``majority/<domain>``, ``uniform/<domain>``); every such key under
            ``zeroshot/`` for the held-out domains (``zeroshot/score``, ...); and with
            ``text_nll``, ``text_nll/<corpus>``, ``text_tokens/<corpus>``, ``text_docs/<corpus>``.
        """
        return self.evaluate_items(model, data)[0]

    def evaluate_items(
        self, model: nn.Module, data: InstructionData
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`evaluate` plus every evaluated item (see
        :func:`fedfm.eval.llm.evaluate_instruction_items`): ``id, domain, metric, prompt,
        reference, answer, truncated, score`` and ``zeroshot`` (whether it is of a held-out
        domain)."""
        out: dict[str, float] = {}
        items: list[dict[str, Any]] = []
        if len(data.rows):
            metrics, seen = self._evaluate_rows(model, data.rows)
            out.update(metrics)
            items += [{**item, "zeroshot": False} for item in seen]
        if data.heldout is not None and len(data.heldout):
            zero, unseen = self._evaluate_rows(model, data.heldout)
            out.update({f"{ZEROSHOT}{k}": v for k, v in zero.items()})
            items += [{**item, "zeroshot": True} for item in unseen]
        if data.documents is not None and self.cfg.text_nll is not None:
            text, docs = self._evaluate_documents(model, data.documents, self.cfg.text_nll)
            out.update(text)
            items += docs
        return out, items

    def _evaluate_documents(
        self, model: nn.Module, docs: datasets.Dataset, cfg: TextNLLConfig
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """``text_nll/<corpus>`` (NLL per token over every scored token), ``text_tokens`` and
        ``text_docs``, and one item per document (``nll``, ``nll_tokens``, no score)."""
        with self.autocast():
            got = text_nlls(
                model, self.tokenizer, docs["text"], cfg.max_tokens, self.cfg.eval_batch_size
            )
        nll, n = sum(g[0] for g in got), sum(g[1] for g in got)
        c = cfg.corpus
        out = {f"{TEXT_NLL}/{c}": nll / n if n else float("nan")}
        out.update({f"text_tokens/{c}": float(n), f"text_docs/{c}": float(len(got))})
        items = [
            {
                "id": f"{c}/{i}",
                "domain": c,
                "metric": TEXT_NLL,
                "prompt": "",
                "reference": text,
                "answer": "",
                "truncated": False,
                "score": None,
                "nll": s,
                "nll_tokens": k,
                "zeroshot": True,
            }
            for i, (s, k, text) in zip(docs["id"], got, strict=True)
        ]
        return out, items

    def _evaluate_rows(
        self, model: nn.Module, rows: datasets.Dataset
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        with self.autocast():
            return evaluate_instruction_items(model, self.tokenizer, rows, self.cfg.settings())

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "local_test_sizes": [len(self._local_test[c]) for c in self.client_ids()],
            "test_size": len(self._test.rows),
            "test_domains": _domain_counts(self._test.rows),
            "heldout_domain": self.cfg.heldout_domain,
            "heldout_domains": list(self.cfg.heldout_domains),
            "heldout_test_size": len(self._test.heldout) if self._test.heldout else 0,
            "heldout_test_domains": _domain_counts(self._test.heldout)
            if self._test.heldout
            else {},
            "reference_tokens_p90": dict(self._budget_p90),
            "text_docs": len(self._test.documents) if self._test.documents else 0,
        }


def _documents(cfg: TextNLLConfig) -> datasets.Dataset:
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


def _with_eval_columns(ds: datasets.Dataset) -> datasets.Dataset:
    """Adds ``domain`` (``general``) and ``metric`` (``rouge``) columns when a source lacks them."""
    if "domain" not in ds.column_names:
        ds = ds.add_column("domain", ["general"] * len(ds))
    if "metric" not in ds.column_names:
        ds = ds.add_column("metric", ["rouge"] * len(ds))
    return ds


def _rows_where(ds: datasets.Dataset, domains: set[str]) -> datasets.Dataset:
    """Rows whose domain is one of ``domains``, in order."""
    return ds.select([i for i, d in enumerate(ds["domain"]) if d in domains])


def _first_per_domain(ds: datasets.Dataset, k: int | None) -> datasets.Dataset:
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


def _domain_counts(ds: datasets.Dataset) -> dict[str, int]:
    domains, counts = np.unique(np.asarray(list(ds["domain"]), dtype=object), return_counts=True)
    return {str(d): int(c) for d, c in zip(domains, counts, strict=True)}


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the trainable tensors of ``model`` (what one FedAvg message carries)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def tokens_in(batch: dict[str, Tensor]) -> int:
    """Non-padding tokens of a batch (for throughput figures)."""
    return int(batch["attention_mask"].sum())


TASKS.register("instruction", "instruction tuning of a causal LM with LoRA (FedIT, quickstart)")(
    InstructionTask
)
