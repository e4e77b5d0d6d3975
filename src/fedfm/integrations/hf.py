"""A Hugging Face ``Trainer`` script, federated: the user's trainer is the local step.

The shape follows NVFlare's Hugging Face integration (a user's ``Trainer`` script runs as a
client's local training, the framework owns the rounds), written here for fedfm's task and
engine. A user's script defines one function (``federated`` by default) that returns a
:class:`TrainerSetup`: the model with its PEFT adapter, each client's tokenised training set,
a held-out set, the data collator and the ``TrainingArguments``. The config names the script:

.. code-block:: yaml

    algorithm: fedavg              # or any server optimizer, DP-FedAvg (privacy.user_level)
    task: {kind: hf_trainer, script: examples/hf_trainer.py, options: {size: smollm2}}
    train: {steps: 4}               # optimizer steps per client and round

What stays the user's: the model and its adapter, the collator, and every training setting of
``TrainingArguments`` (optimizer, learning rate and schedule, weight decay, clipping,
gradient accumulation, precision); the ``Trainer`` subclass too (``trainer_cls``, e.g. TRL's
``SFTTrainer``). What is fedfm's: rounds, client sampling, the number of local steps
(``train.steps`` or ``train.epochs``), the order of each client's batches (seeded by run,
round and client, so a run repeats on both runtimes), aggregation of the adapter's tensors
(the trainable parameters travel, the frozen base never does), the audit ledger, DP-FedAvg's
clipping and noise of the update with its privacy ledger, checkpoints, resume and the report.

Choices of ours:

* The ``Trainer`` is built afresh for each client round (its optimizer and schedule restart
  each round, as fedfm's own loop does) with ``max_steps`` set to fedfm's step count and
  ``seed`` to the client round's seed; it reads the batches fedfm drew (the collator applied
  to a seeded permutation of the client's rows, consecutive full batches of
  ``per_device_train_batch_size``, reshuffled each pass) instead of its own sampler.
* Logging, checkpointing and progress bars of the ``Trainer`` are off (``report_to=[]``,
  ``save_strategy="no"``): the run folder is fedfm's.
* Server-side evaluation is the mean loss of the model on the held-out set (``loss``, lower
  is better) and its perplexity ``ppl``.
* Algorithms that change the local loss or gradient (FedProx's proximal term, SCAFFOLD's
  correction, knowledge distillation) are refused: the user's ``Trainer`` owns the loss.
  DP-SGD inside the trainer is not offered (Opacus needs fedfm's own loop).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from fedfm.config import RunConfig, TrainConfig
from fedfm.core.train import TrainResult
from fedfm.devices import to_device
from fedfm.errors import ConfigError, FedfmError
from fedfm.tasks.base import TASKS, Task, TaskConfig

REFUSED_ALGORITHMS = ("fedprox", "scaffold")
"""FedAvg-family algorithms whose local step changes the loss or the gradient."""


@dataclasses.dataclass
class TrainerSetup:
    """What a user's script hands fedfm: everything a ``Trainer`` needs, per client.

    Attributes:
        model: The model with its PEFT adapter (only parameters with ``requires_grad``
            travel and are averaged; the frozen base stays in each process).
        clients: Client id -> its tokenised training set (rows the collator takes).
        test: The held-out tokenised set the server evaluates on.
        args: The ``TrainingArguments`` of the local step.
        collator: The data collator (``None``: the ``Trainer``'s default).
        trainer_cls: The ``Trainer`` class (e.g. a subclass of the user's, TRL's
            ``SFTTrainer``); called as ``trainer_cls(model=, args=, data_collator=,
            train_dataset=)``.
    """

    model: nn.Module
    clients: Mapping[str, Any]
    test: Any
    args: Any
    collator: Callable[[list[Any]], dict[str, Any]] | None = None
    trainer_cls: Any = None


class HFTrainerConfig(TaskConfig):
    """Config of a Hugging Face ``Trainer`` script (``task.kind: hf_trainer``).

    Attributes:
        script: Path of the user's Python script.
        factory: The function in it that returns a :class:`TrainerSetup`.
        options: Keyword arguments of that function (e.g. ``{size: tiny}``).
    """

    kind: Literal["hf_trainer"] = "hf_trainer"
    script: str
    factory: str = "federated"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("script")
    @classmethod
    def _absolute(cls, value: str) -> str:
        # Flower's client processes need not share this process's working directory.
        return str(Path(value).expanduser().resolve())


def load_setup(cfg: HFTrainerConfig) -> TrainerSetup:
    """Runs the user's factory.

    Raises:
        ConfigError: The script is missing, has no such function, or it returns no
            :class:`TrainerSetup` (fields ``task.script``, ``task.factory``).
    """
    path = Path(cfg.script).expanduser()
    if not path.is_file():
        raise ConfigError("task.script", f"no such file: {path}")
    name = f"fedfm_user_{path.stem}"
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != str(path.resolve()):
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        if spec is None or spec.loader is None:
            raise ConfigError("task.script", f"{path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    factory = getattr(module, cfg.factory, None)
    if not callable(factory):
        raise ConfigError("task.factory", f"{path} defines no function '{cfg.factory}'")
    setup = factory(**cfg.options)
    if not isinstance(setup, TrainerSetup):
        raise ConfigError("task.factory", f"'{cfg.factory}' returned no TrainerSetup")
    if not setup.clients:
        raise ConfigError("task.factory", f"'{cfg.factory}' returned no clients")
    return setup


class HFTrainerTask(Task):
    """A user's ``Trainer`` script as a task.

    Its clients train with that ``Trainer`` (:class:`fedfm.core.train.OwnLocalStep`).
    """

    Config = HFTrainerConfig
    kind = "lm"
    primary = "loss"
    higher_is_better = False

    def __init__(self, cfg: HFTrainerConfig, run: RunConfig) -> None:
        super().__init__(cfg, run)
        self.setup = load_setup(cfg)
        self.model = self.setup.model.to(self.device)

    @classmethod
    def check_run(cls, cfg: TaskConfig, run: RunConfig) -> None:
        """Refuses an algorithm that changes the local loss (field ``algorithm``)."""
        if run.algorithm in REFUSED_ALGORITHMS:
            raise ConfigError(
                "algorithm",
                f"{run.algorithm} changes the local loss, which the user's Trainer owns:"
                " use fedavg, a server optimizer or DP-FedAvg",
            )

    def client_ids(self) -> list[str]:
        """The script's clients, sorted."""
        return sorted(self.setup.clients)

    def client_data(self, cid: str) -> Any:
        """The client's tokenised training set."""
        return self.setup.clients[cid]

    def client_test_data(self, cid: str) -> Any:
        """The held-out set (the script gives no per-client test sets)."""
        return self.setup.test

    def test_data(self) -> Any:
        """The held-out set."""
        return self.setup.test

    def num_examples(self, data: Any) -> int:
        """Rows of a tokenised set."""
        return len(data)

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """The script's model (one per process: its adapter is loaded from every message)."""
        if overrides:
            raise ConfigError("task", "an hf_trainer model takes no architecture overrides")
        return self.model

    def _collate(self, rows: list[Any]) -> dict[str, Tensor]:
        if self.setup.collator is not None:
            return dict(self.setup.collator(rows))
        from transformers import default_data_collator

        return dict(default_data_collator(rows))

    def batches(self, data: Any, batch_size: int, seed: int) -> Iterator[dict[str, Tensor]]:
        """Consecutive full batches of a seeded permutation of the rows.

        Consecutive full batches of a seeded permutation of the rows, reshuffled each pass
        (one short batch when the set is smaller than a batch).
        """
        rng = np.random.default_rng(seed)
        n = len(data)
        while True:
            order = rng.permutation(n)
            for start in range(0, max(n - batch_size, 0) + 1, batch_size):
                yield self._collate([data[int(i)] for i in order[start : start + batch_size]])

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, Any]:
        """The model's own loss (``labels`` in the batch), as the ``Trainer`` computes it."""
        out = model(**batch)
        return out.loss, out

    def local_step(
        self, model: nn.Module, data: Any, cfg: TrainConfig, steps: int, seed: int, **kw: Any
    ) -> TrainResult:
        """``steps`` optimizer steps of the user's ``Trainer`` on fedfm's batches.

        Raises:
            FedfmError: The algorithm asks for a change of the loss or the gradient.
        """
        # FedAvg hands every loop its received weights (prox_ref); only a proximal weight
        # would use them.
        if not cfg.prox_mu:
            kw.pop("prox_ref", None)
        extras = sorted(k for k, v in kw.items() if v is not None)
        if extras:
            raise FedfmError(f"the hf_trainer local step cannot honour {', '.join(extras)}")
        return run_trainer(self.setup, model, self.batches, data, steps, seed)

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        """Mean loss per batch over the held-out set, and its exponential ``ppl``."""
        size = int(getattr(self.setup.args, "per_device_eval_batch_size", 8))
        was = model.training
        model.eval()
        losses = []
        with torch.no_grad():
            for start in range(0, len(data), size):
                batch = self._collate([data[i] for i in range(start, min(start + size, len(data)))])
                losses.append(float(self.loss(model, to_device(batch, self.device))[0]))
        model.train(was)
        loss = float(np.mean(losses))
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def save_adapter(self, model: nn.Module, folder: Path) -> bool:
        """The adapter in peft's format, when the model is a ``PeftModel``."""
        import peft

        if not isinstance(model, peft.PeftModel):
            return False
        model.save_pretrained(str(folder))
        return True

    def stats(self) -> dict[str, Any]:
        """Rows per client."""
        return {"clients": {cid: len(d) for cid, d in sorted(self.setup.clients.items())}}


class _Batches(torch.utils.data.Dataset[Any]):
    """Ready batches as a map-style data set (a ``DataLoader`` with ``batch_size=None``)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def run_trainer(
    setup: TrainerSetup,
    model: nn.Module,
    batches: Callable[[Any, int, int], Iterator[Any]],
    data: Any,
    steps: int,
    seed: int,
) -> TrainResult:
    """Runs the user's ``Trainer`` on ``model`` for ``steps`` optimizer steps.

    Runs the user's ``Trainer`` on ``model`` for ``steps`` optimizer steps, reading the
    batches ``batches(data, per_device_train_batch_size, seed)`` draws.
    """
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    base = setup.args
    accumulate = max(1, int(getattr(base, "gradient_accumulation_steps", 1)))
    drawn = batches(data, int(base.per_device_train_batch_size), seed)
    feed = [next(drawn) for _ in range(steps * accumulate)]
    with tempfile.TemporaryDirectory(prefix="fedfm-trainer-") as out:
        args = dataclasses.replace(
            base,
            output_dir=out,
            max_steps=steps,
            seed=seed % 2**31,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        loader = torch.utils.data.DataLoader(_Batches(feed), batch_size=None, shuffle=False)

        class FedfmBatches(setup.trainer_cls or Trainer):  # type: ignore[misc]
            """The user's Trainer reading fedfm's batches instead of its own sampler."""

            def get_train_dataloader(self) -> Any:
                return loader

        trainer = FedfmBatches(
            model=model, args=args, data_collator=setup.collator, train_dataset=data
        )
        # The run's display is fedfm's: no printed log dictionaries.

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        out_train = trainer.train()
    return TrainResult(steps, float(out_train.training_loss))


TASKS.register("hf_trainer", "a Hugging Face Trainer script as the local step (FedAvg family)")(
    HFTrainerTask
)
