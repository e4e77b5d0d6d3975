"""Text classification tasks, and a LoRA-tuned sentence encoder as a client model.

Sources (``fedfm.data.sources``): ``rotten_tomatoes``, ``sms_spam``, ``trec``,
``drug_reviews``, ``amazon_food``. The default model is the fastText-style
``TextClassifier`` student (Joulin et al. 2017) fed by its hashing tokenizer; texts are
tokenised once when the task is built. ``encoder-lora-classifier`` is the other kind of
model: a frozen sentence encoder (all-MiniLM-L6-v2) with LoRA adapters (Hu et al. 2022,
through :mod:`fedfm.models.lora`) and a linear head, fed raw texts; federated LoRA on a
foundation model, FedRD's memory baseline, trains it on the clients.

Choices of ours (simulation practice): each client holds out ``local_test_fraction`` of its
partition for personalised evaluation; a source without a test split gives
``test_fraction`` of its rows to the server; ``public_size`` rows of the training pool are
carved out *before* partitioning as a public proxy set for server-side distillation, so it
is disjoint from every client's data by sample id (checked).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from fedfm.config import validate_section
from fedfm.core.groups import join_groups
from fedfm.core.seeding import derive_seed
from fedfm.data.partition import PartitionConfig, partition, partition_stats
from fedfm.data.sources import LoadedSource, load_source
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError
from fedfm.models.registry import MODELS, build_model
from fedfm.models.students import PAD_ID, HashingTokenizer
from fedfm.tasks.base import (
    PUBLIC_SPLIT,
    SOURCE_ROWS,
    SPLIT_INPUTS,
    TASKS,
    TEXT_VIEW,
    Task,
    TaskConfig,
    classification_metrics,
)

# Models fed hashed n-gram ids; every other model is fed the raw texts.
HASHED_MODELS = ("text-classifier",)
ADAPTER = "adapter"
"""The LoRA adapter of ``encoder-lora-classifier`` (and its group in the tensors that travel)."""


@dataclass
class TextData:
    """Texts with labels and stable sample ids.

    Attributes:
        texts: The texts.
        y: Class indices ``[N]`` (int64).
        ids: Stable sample ids ``[N]`` from the source.
        bags: Hashed n-gram ids per text (one 1-D int64 tensor each) when the task's model
            reads hashed ids, else ``None``.
    """

    texts: list[str]
    y: Tensor
    ids: Tensor
    bags: list[Tensor] | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: Tensor | Sequence[int]) -> TextData:
        """Rows ``idx`` as a new TextData."""
        rows = [int(i) for i in idx]
        index = torch.as_tensor(rows, dtype=torch.long)
        bags = [self.bags[i] for i in rows] if self.bags is not None else None
        return TextData([self.texts[i] for i in rows], self.y[index], self.ids[index], bags)

    def inputs(self, idx: Sequence[int]) -> Tensor | list[str]:
        """Model inputs of rows ``idx``: padded ids ``[B, L]`` or a list of texts."""
        if self.bags is None:
            return [self.texts[int(i)] for i in idx]
        bags = [self.bags[int(i)] for i in idx]
        # A text with no n-gram gets one padding id, which the bag mean ignores.
        bags = [b if b.numel() else torch.tensor([PAD_ID]) for b in bags]
        return pad_sequence(bags, batch_first=True, padding_value=PAD_ID)


class TextConfig(TaskConfig):
    """Config of a text-classification task."""

    kind: Literal["text"] = "text"
    dataset: str = "trec"
    source_options: dict[str, Any] = Field(default_factory=dict)
    model: str = "text-classifier"
    model_args: dict[str, Any] = Field(default_factory=dict)
    vocab_size: int = Field(2**15, ge=2, description="hash buckets of the n-gram tokenizer")
    max_ngrams: int = Field(512, ge=1, description="n-grams kept per text (hashed models)")
    test_fraction: float = Field(0.2, gt=0, lt=1)
    local_test_fraction: float = Field(0.2, ge=0, lt=1)
    max_train: int | None = Field(None, ge=10)
    max_test: int | None = Field(None, ge=10, description="subsample the server's test set")
    public_size: int = Field(0, ge=0, description="public proxy rows carved before partitioning")


class TextTask(Task):
    """Text classification over a registered text source, partitioned over clients.

    Same API as :class:`~fedfm.tasks.supervised.SupervisedTask`: data are :class:`TextData`,
    batches are ``(inputs, y)`` with ``inputs`` padded hashed ids ``[B, L]`` (for
    ``text-classifier``) or a list of texts (for encoder models); metrics are accuracy,
    macro-F1 and loss. :meth:`public_data` returns the public split (empty unless
    ``public_size`` > 0).
    """

    Config = TextConfig
    kind = "classification"

    def __init__(self, cfg: TextConfig, run: Any) -> None:
        super().__init__(cfg, run)
        self.cfg: TextConfig = cfg
        src = load_source(cfg.dataset, **cfg.source_options)
        if src.info.kind != "text-classification":
            raise ConfigError("task.dataset", f"'{cfg.dataset}' is a {src.info.kind} set, not text")
        self.src = src
        self.num_classes = int(src.num_classes or 0)
        self.hashed = cfg.model in HASHED_MODELS
        self.tokenizer = HashingTokenizer(cfg.vocab_size) if self.hashed else None
        train, test = self._split(src)
        train, public = self._carve_public(train)
        self.pcfg = validate_section(
            PartitionConfig, {"seed": run.seed, **run.partition}, "partition"
        )
        parts = partition(train, self.pcfg)
        self._stats = partition_stats(parts, "label")
        self._test = self.to_data(test)
        self._public = self.to_data(public)
        self._clients: dict[str, TextData] = {}
        self._local_test: dict[str, TextData] = {}
        for i, p in enumerate(parts):
            data = self.to_data(p)
            n_test = round(cfg.local_test_fraction * len(data))
            g = torch.Generator().manual_seed(derive_seed(run.seed, "local-test", i))
            perm = torch.randperm(len(data), generator=g)
            self._local_test[str(i)] = data.subset(perm[:n_test])
            self._clients[str(i)] = data.subset(perm[n_test:])
        check_disjoint(self._public.ids, self._all_client_ids(), "task.public_size")

    def _split(self, src: LoadedSource) -> tuple[Any, Any]:
        train, test = src.train, src.test
        if test is None:
            split = train.train_test_split(test_size=self.cfg.test_fraction, seed=self.run.seed)
            train, test = split["train"], split["test"]
        if self.cfg.max_train is not None and len(train) > self.cfg.max_train:
            train = train.shuffle(seed=self.run.seed).select(range(self.cfg.max_train))
        if self.cfg.max_test is not None and len(test) > self.cfg.max_test:
            test = test.shuffle(seed=self.run.seed).select(range(self.cfg.max_test))
        return train, test

    def _carve_public(self, train: Any) -> tuple[Any, Any]:
        k = self.cfg.public_size
        if k >= len(train):
            raise ConfigError(
                "task.public_size", f"{k} public rows leave no client data ({len(train)} rows)"
            )
        order = np.random.default_rng(derive_seed(self.run.seed, "public")).permutation(len(train))
        public = train.select(sorted(order[:k].tolist()))
        return train.select(sorted(order[k:].tolist())), public

    def _all_client_ids(self) -> Tensor:
        parts = [*self._clients.values(), *self._local_test.values()]
        return torch.cat([d.ids for d in parts]) if parts else torch.zeros(0, dtype=torch.long)

    def to_data(self, ds: Any) -> TextData:
        """Rows of a source dataset (columns ``id, text, label``) as :class:`TextData`."""
        texts = [str(t) for t in ds["text"]]
        y = torch.as_tensor(np.asarray(ds["label"], dtype=np.int64))
        ids = torch.as_tensor(np.asarray(ds["id"], dtype=np.int64))
        bags = None
        if self.tokenizer is not None:
            flat, offsets = self.tokenizer.encode(texts)
            ends = [*offsets[1:].tolist(), flat.numel()] if len(offsets) else []
            bags = [
                flat[s:e][: self.cfg.max_ngrams]
                for s, e in zip(offsets.tolist(), ends, strict=True)
            ]
        return TextData(texts, y, ids, bags)

    # ----- Task API -----
    def client_ids(self) -> list[str]:
        """All client ids, in a stable order."""
        return list(self._clients)

    def client_data(self, cid: str) -> TextData:
        """Training rows of one client."""
        return self._clients[cid]

    def client_test_data(self, cid: str) -> TextData:
        """Held-out local rows of one client."""
        return self._local_test[cid]

    def test_data(self) -> TextData:
        """The global test rows."""
        return self._test

    def public_data(self) -> TextData:
        """The public proxy split (disjoint from client data by sample id; may be empty)."""
        return self._public

    def num_examples(self, data: TextData) -> int:
        """Number of rows in ``data``."""
        return len(data)

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """A seeded model from the registry; ``overrides`` replace ``model_args``."""
        args = {**self.cfg.model_args, **overrides}
        name = args.pop("name", self.cfg.model)
        if (name in HASHED_MODELS) != self.hashed:
            raise ConfigError(
                "task.model", f"model '{name}' reads other inputs than '{self.cfg.model}'"
            )
        torch.manual_seed(seed)
        if self.hashed:
            args.setdefault("vocab_size", self.cfg.vocab_size)
            if args["vocab_size"] != self.cfg.vocab_size:
                raise ConfigError(
                    "task.model_args.vocab_size",
                    f"{args['vocab_size']} differs from the tokenizer's {self.cfg.vocab_size}",
                )
        return build_model(name, num_classes=self.num_classes, **args).to(self.device)

    def batches(
        self, data: TextData, batch_size: int, seed: int
    ) -> Iterator[tuple[Tensor | list[str], Tensor]]:
        """An endless iterator of seeded shuffled ``(inputs, labels)`` batches."""
        g = torch.Generator().manual_seed(seed)
        n = len(data)
        if n == 0:
            raise ValueError("cannot draw batches from an empty client dataset")
        while True:
            perm = torch.randperm(n, generator=g).tolist()
            for s in range(0, n, batch_size):
                idx = perm[s : s + batch_size]
                yield data.inputs(idx), data.y[idx]

    def loss(self, model: nn.Module, batch: tuple[Any, Tensor]) -> tuple[Tensor, Tensor]:
        """Cross-entropy loss and the model outputs for a batch."""
        x, y = to_device(batch, model_device(model))  # texts stay a list of strings
        out = model(x)
        return nn.functional.cross_entropy(out, y), out

    @torch.no_grad()
    def predict(self, model: nn.Module, data: TextData, batch_size: int = 256) -> Tensor:
        """Logits ``[N, C]`` of ``model`` on ``data`` in eval mode, on the CPU."""
        was = model.training
        model.eval()
        idx, device = list(range(len(data))), model_device(model)
        outs = [
            model(to_device(data.inputs(idx[s : s + batch_size]), device)).cpu()
            for s in range(0, len(idx), batch_size)
        ]
        model.train(was)
        return torch.cat(outs) if outs else torch.zeros(0, self.num_classes)

    def evaluate(self, model: nn.Module, data: TextData) -> dict[str, float]:
        """Classification metrics of ``model`` on ``data``."""
        if len(data) == 0:
            return {}
        out = self.predict(model, data)
        return classification_metrics(out, data.y)

    def stats(self) -> dict[str, Any]:
        """Partition statistics plus test and public sizes and the class count."""
        return {
            **self._stats,
            "local_test_sizes": [len(self._local_test[c]) for c in self.client_ids()],
            "test_size": len(self._test),
            "public_size": len(self._public),
            "num_classes": self.num_classes,
        }

    # ----- optional capabilities -----
    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """Source rows, split inputs and a text view; a public split when configured."""
        caps = {SOURCE_ROWS, SPLIT_INPUTS, TEXT_VIEW}
        if isinstance(cfg, TextConfig) and cfg.public_size > 0:
            caps.add(PUBLIC_SPLIT)
        return frozenset(caps)

    def pool_ids(self) -> np.ndarray:
        """Sample ids of the source's training rows (the clients' pool)."""
        return np.asarray(self.src.train["id"])

    def rows(self, ids: Sequence[int]) -> TextData:
        """The training rows with these sample ids, in the source's order."""
        positions = np.flatnonzero(np.isin(self.pool_ids(), np.asarray(ids)))
        return self.to_data(self.src.train.select(positions.tolist()))

    def inputs(self, data: TextData, idx: Sequence[int]) -> Tensor | list[str]:
        """Model inputs of rows ``idx`` of ``data``."""
        return data.inputs(idx)

    def texts(self, data: TextData) -> list[str]:
        """The raw texts of ``data``."""
        return list(data.texts)


def check_disjoint(public_ids: Tensor, client_ids: Tensor, field: str) -> None:
    """Refuses a public set that shares sample ids with client data.

    Raises:
        ConfigError: Some ids are shared (the count and a few examples are named).
    """
    shared = np.intersect1d(public_ids.numpy(), client_ids.numpy())
    if len(shared):
        raise ConfigError(
            field,
            f"public set overlaps client data: {len(shared)} shared sample ids "
            f"(e.g. {shared[:5].tolist()})",
        )


class EncoderLoraClassifier(nn.Module):
    """A frozen sentence encoder with LoRA adapters and a linear head, fed raw texts.

    ``features(texts)`` is the encoder's sentence embedding (for all-MiniLM-L6-v2: mean
    pooling over tokens, then L2 normalisation; 384-d); ``head`` is ``Linear(dim, classes)``.
    Only the LoRA tensors and the head are trainable, and only they travel
    (:meth:`exchanged_tensors`): the adapter under peft's saved keys in group
    :data:`ADAPTER`, as every adapter leaves fedfm (:mod:`fedfm.models.lora`), the head in group
    ``head``. It is its own module, not a :class:`fedfm.fm.FoundationModel`: the handle serves
    causal LMs (chat prompts, generation, decoder features, DP-SGD over token rows), while this
    model is a sentence-transformers encoder fed raw texts with a trainable head beside its
    adapter; it uses the same :mod:`fedfm.models.lora` functions and key format.

    Args:
        num_classes: Classes.
        encoder: Sentence encoder name or folder (see
            :func:`fedfm.models.encoders.load_sentence_encoder`).
        r: LoRA rank.
        alpha: LoRA scale numerator.
        dropout: LoRA dropout.
        target_modules: Linear layers to adapt (BERT names: query, key, value, dense).
        max_length: Longest token sequence (truncation).
    """

    def __init__(
        self,
        num_classes: int,
        encoder: str = "all-MiniLM-L6-v2",
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.05,
        target_modules: Sequence[str] = ("query", "key", "value"),
        max_length: int = 128,
    ) -> None:
        super().__init__()
        from fedfm.models.encoders import load_sentence_encoder
        from fedfm.models.lora import LoraConfigSpec, add_adapters

        st = load_sentence_encoder(encoder)
        st.max_seq_length = max_length
        for p in st.parameters():
            p.requires_grad_(False)
        spec = LoraConfigSpec(
            r=r, alpha=alpha, dropout=dropout, target_modules=list(target_modules)
        )
        transformer: Any = st[0]
        # ``auto_model`` is a read-only alias of ``model`` in sentence-transformers.
        transformer.model = add_adapters(transformer.model, [ADAPTER], spec)
        self.encoder = st
        dim = st.get_embedding_dimension()
        if dim is None:
            raise ConfigError("task.model_args.encoder", f"'{encoder}' has no embedding width")
        self.feature_dim = int(dim)
        self.head = nn.Linear(self.feature_dim, num_classes)

    def exchanged_tensors(self) -> dict[str, Tensor]:
        """The adapter (``adapter/<saved key>``) and the head (``head/weight``, ``head/bias``).

        These are the live tensors that travel (:class:`fedfm.core.train.ExchangedTensors`).
        """
        from fedfm.models.lora import adapter_tensors

        transformer: Any = self.encoder[0]
        adapter: dict[str, Tensor] = dict(adapter_tensors(transformer.auto_model, ADAPTER))
        return join_groups({ADAPTER: adapter, "head": dict(self.head.named_parameters())})

    def features(self, texts: Sequence[str]) -> Tensor:
        """Texts -> [B, feature_dim] sentence embeddings (differentiable through LoRA)."""
        if isinstance(texts, str):
            raise ConfigError("texts", "expected a list of strings, got a single string")
        feats = to_device(self.encoder.preprocess(list(texts)), model_device(self))
        return self.encoder(feats)["sentence_embedding"]

    def forward(self, texts: Sequence[str]) -> Tensor:
        """Texts -> [B, num_classes] logits."""
        return self.head(self.features(texts))


MODELS.register(
    "encoder-lora-classifier", help="sentence encoder (MiniLM) + LoRA adapters + linear head"
)(EncoderLoraClassifier)
TASKS.register("text", "text classification (TREC, drug reviews, SMS spam, ...)")(TextTask)
