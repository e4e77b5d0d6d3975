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
(``text_nll``: plain documents such as C4's) is scored by its NLL per token and its top-1
token accuracy, and ``likelihood_only`` scores without generating anything (labels by
log-likelihood, the other items by their reference's NLL, kept per item). Beside the scores, each
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
from typing import Any

import datasets
import numpy as np
import torch
from torch import Tensor, nn

from fedfm.config import validate_section
from fedfm.core.seeding import derive_seed
from fedfm.data.partition import PartitionConfig, partition, partition_stats
from fedfm.data.prompt import InstructionBatches
from fedfm.data.sources import load_source
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError, FedfmError
from fedfm.eval.llm import (
    evaluate_instruction_items,
    text_scores,
)
from fedfm.fm import FoundationModel
from fedfm.models.causal_lm import LMBundle, check_lm_setup
from fedfm.models.generation import pad_id_of
from fedfm.models.lm_loss import response_loss
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import FOUNDATION_MODEL, ITEM_RESULTS, TASKS, Task, TaskConfig
from fedfm.tasks.instructions import (
    REF_NLL,
    TEXT_NLL,
    TEXT_TOP1,
    ZEROSHOT,
    InstructionConfig,
    TextNLLConfig,
    checked_primary,
    documents,
    domain_counts,
    first_per_domain,
    hold_out,
    partition_section,
    per_domain_eval,
    split_rows,
    warn_short_budgets,
    with_eval_columns,
    zeroshot_items,
)

log = logging.getLogger("fedfm")


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
    """The handle on the task's model, on ``device`` (the CPU when ``None``).

    It carries the task's base, dtype, LoRA and prompt settings, and autocast.
    """
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
        train, test = split_rows(cfg, run.seed, with_eval_columns(src.train), src.test)
        train, test, zeroshot = hold_out(cfg, train, test)
        section = partition_section(cfg, run, train)
        self.pcfg = validate_section(PartitionConfig, section, "partition")
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
        per_domain = per_domain_eval(cfg, test)
        self._test = InstructionData(
            first_per_domain(test, per_domain),
            zeroshot_items(cfg, zeroshot, per_domain) if zeroshot is not None else None,
            documents(cfg.text_nll) if cfg.text_nll is not None else None,
        )
        self.primary = checked_primary(cfg, self._test.rows, self._test.heldout)
        # A reference NLL is better low.
        self.higher_is_better = self.primary.removeprefix(ZEROSHOT).partition("/")[0] != REF_NLL
        parts = [self._test.rows, *([self._test.heldout] if self._test.heldout else [])]
        self._budget_p90 = warn_short_budgets(cfg, parts, self.tokenizer)

    # ----- the shared model -----
    @classmethod
    def check_run(cls, cfg: TaskConfig, run: Any) -> None:
        """Refuses, before any weight is loaded, an LM setup ``run.device`` cannot run."""
        assert isinstance(cfg, InstructionConfig)
        check_lm_setup(cfg.model, cfg.model_args, cfg.lora, cfg.quantization, run.device)

    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """The foundation model and per-item results."""
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
        """Autocast when ``autocast_bf16`` is set, else a no-op context.

        See :meth:`FoundationModel.autocast`.
        """
        return self.foundation_model().autocast()

    # ----- Task API -----
    def client_ids(self) -> list[str]:
        """All client ids, in a stable order."""
        return list(self._clients)

    def client_data(self, cid: str) -> InstructionData:
        """Training rows of one client."""
        return self._clients[cid]

    def client_test_data(self, cid: str) -> InstructionData:
        """Held-out local rows of one client."""
        return self._local_test[cid]

    def test_data(self) -> InstructionData:
        """The global test rows."""
        return self._test

    def num_examples(self, data: InstructionData) -> int:
        """Number of rows in ``data``."""
        return len(data)

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """The handle's shared ``PeftModel`` with adapter :data:`ADAPTER` freshly initialised.

        That adapter is the only active and trainable one; other adapters keep their tensors.

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
        """Adapter :data:`ADAPTER` of the model (:meth:`build_model`'s), through the handle.

        Keys are peft's saved keys, the adapter not named.
        """
        state = self._handle_of(model).get_adapter(ADAPTER)
        return state if names is None else {k: state[k] for k in names}

    def set_params(self, model: nn.Module, params: Mapping[str, Tensor]) -> None:
        """Puts ``params`` (every tensor of an adapter of this shape) into :data:`ADAPTER`."""
        self._handle_of(model).set_adapter(ADAPTER, params)

    def param_names(self, model: nn.Module) -> dict[str, str]:
        """Key of each tensor of adapter :data:`ADAPTER` -> its parameter name in ``model``."""
        return self._handle_of(model).param_names(ADAPTER)

    def save_adapter(self, model: nn.Module, folder: Path) -> bool:
        """Writes :data:`ADAPTER` in peft's format into ``folder``."""
        self._handle_of(model).save_adapter(ADAPTER, folder)
        return True

    def _handle_of(self, model: nn.Module) -> FoundationModel:
        """The handle whose shared model ``model`` is.

        Any other model is refused, since its adapter would not be the one read or written.
        """
        fm = self.foundation_model()
        if model is not fm.model:
            raise FedfmError(f"{type(model).__name__} is not this task's model (build_model's)")
        return fm

    def encode(self, data: InstructionData) -> list[dict[str, list[int]]]:
        """Token ids, attention masks and response-only labels of ``data`` (cached on it).

        Encoded by the foundation model's one row encoder (:meth:`FoundationModel.encode`).
        """
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
        """Mean cross-entropy over response tokens (labels are -100 elsewhere).

        The head is applied to the scored positions only (:func:`response_loss`).
        """
        with self.autocast():
            return response_loss(model, to_device(batch, model_device(model)))

    def evaluate(self, model: nn.Module, data: InstructionData) -> dict[str, float]:
        """Per-domain and overall metrics on ``data``; ``zeroshot/...`` for held-out domains.

        Returns:
            ``score`` (mean over domains), ``score/<domain>``, each metric kind overall and
            per domain (``rougeL``, ``gsm8k_acc``, ``acc``), ``ppl`` when ``eval_ppl``, counts
            ``n``, the instrument readouts (``truncated/<domain>``, ``pred/<domain>/<label>``,
            ``majority/<domain>``, ``uniform/<domain>``); every such key under
            ``zeroshot/`` for the held-out domains (``zeroshot/score``, ...); and with
            ``text_nll``, ``text_nll/<corpus>``, ``text_top1/<corpus>``, ``text_tokens/<corpus>``,
            ``text_docs/<corpus>``.
        """
        return self.evaluate_items(model, data)[0]

    def evaluate_items(
        self, model: nn.Module, data: InstructionData
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`evaluate` plus every evaluated item.

        See :func:`fedfm.eval.llm.evaluate_instruction_items`. Each item has ``id, domain, metric,
        prompt, reference, answer, truncated, score`` and ``zeroshot`` (whether it is of a held-out
        domain).
        """
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
        """Per-token NLL and top-1 token accuracy of each corpus, counts, one item per document.

        The metrics are ``text_nll/<corpus>`` (NLL per token over every scored token),
        ``text_top1/<corpus>`` (the share of scored tokens that are the model's top-1
        prediction, from the same forward pass), ``text_tokens`` and ``text_docs``; each item
        has ``nll``, ``nll_tokens`` and ``top1`` (its top-1 hits), no score.
        """
        with self.autocast():
            got = text_scores(
                model, self.tokenizer, docs["text"], cfg.max_tokens, self.cfg.eval_batch_size
            )
        nll, n = sum(g.nll for g in got), sum(g.tokens for g in got)
        hits = sum(g.top1 for g in got)
        c = cfg.corpus
        out = {f"{TEXT_NLL}/{c}": nll / n if n else float("nan")}
        out[f"{TEXT_TOP1}/{c}"] = hits / n if n else float("nan")
        out.update({f"text_tokens/{c}": float(n), f"text_docs/{c}": float(len(got))})
        items = [
            {
                "id": f"{c}/{i}",
                "domain": c,
                "metric": TEXT_NLL,
                "prompt": "",
                "reference": g.text,
                "answer": "",
                "truncated": False,
                "score": None,
                "nll": g.nll,
                "nll_tokens": g.tokens,
                "top1": g.top1,
                "zeroshot": True,
            }
            for i, g in zip(docs["id"], got, strict=True)
        ]
        return out, items

    def _evaluate_rows(
        self, model: nn.Module, rows: datasets.Dataset
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        with self.autocast():
            return evaluate_instruction_items(model, self.tokenizer, rows, self.cfg.settings())

    def stats(self) -> dict[str, Any]:
        """Partition statistics plus test sizes, domains and reference budgets."""
        return {
            **self._stats,
            "local_test_sizes": [len(self._local_test[c]) for c in self.client_ids()],
            "test_size": len(self._test.rows),
            "test_domains": domain_counts(self._test.rows),
            "heldout_domain": self.cfg.heldout_domain,
            "heldout_domains": list(self.cfg.heldout_domains),
            "heldout_test_size": len(self._test.heldout) if self._test.heldout else 0,
            "heldout_test_domains": domain_counts(self._test.heldout) if self._test.heldout else {},
            "reference_tokens_p90": dict(self._budget_p90),
            "text_docs": len(self._test.documents) if self._test.documents else 0,
        }


def tokens_in(batch: dict[str, Tensor]) -> int:
    """Non-padding tokens of a batch (for throughput figures)."""
    return int(batch["attention_mask"].sum())


TASKS.register("instruction", "instruction tuning of a causal LM with LoRA (FedIT, quickstart)")(
    InstructionTask
)
