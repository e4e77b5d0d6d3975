"""fedfm.integrations.hf: a Hugging Face Trainer as the local step of the FedAvg family.

The example script (examples/hf_trainer.py) at its tiny size: a run through the ``fedfm``
command, and the integration's local step against fedfm's own loop on the same batches.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from fedfm.config import TrainConfig, load_config
from fedfm.core.train import local_train, trainable
from fedfm.errors import ConfigError
from fedfm.integrations.hf import HFTrainerConfig, HFTrainerTask, run_trainer
from fedfm.runtime import run
from helpers import REPO
from helpers.cli import run_cli
from helpers.grid import same_run

SCRIPT = REPO / "examples" / "hf_trainer.py"
TINY = {"size": "tiny", "per_domain": 8, "max_length": 64}

# float32 on a CPU: the same batches through the same optimizer in two loops agree to
# rounding; 1e-6 on the adapter's weights is far below one step's change (lr x grad).
TOLERANCE = 1e-6


def _task(tmp_path, **algo) -> HFTrainerTask:
    cfg = load_config(
        {
            "name": "hf",
            "out_dir": str(tmp_path),
            "task": {"kind": "hf_trainer", "script": str(SCRIPT), "options": TINY},
            **algo,
        }
    )
    return HFTrainerTask(HFTrainerConfig(script=str(SCRIPT), options=TINY), cfg)


@pytest.mark.parametrize(("optim", "fedfm_optimizer"), [("sgd", "sgd"), ("adamw_torch", "adamw")])
def test_the_trainer_step_equals_fedfms_own_loop_on_the_same_batches(
    tmp_path, optim, fedfm_optimizer
):
    task = _task(tmp_path)
    lr, steps, seed = 0.05, 3, 11
    setup = dataclasses.replace(
        task.setup,
        args=dataclasses.replace(
            task.setup.args,
            optim=optim,
            learning_rate=lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,  # no clipping, as fedfm's clip_norm None
            warmup_steps=0,
        ),
    )
    data = task.client_data("movie")
    ours, theirs = copy.deepcopy(task.model), copy.deepcopy(task.model)
    before = {k: v.detach().clone() for k, v in trainable(ours).items()}
    cfg = TrainConfig(optimizer=fedfm_optimizer, lr=lr, steps=steps, batch_size=4)
    own = local_train(ours, task.batches(data, 4, seed), task.loss, cfg, steps)
    got = run_trainer(setup, theirs, task.batches, data, steps, seed)
    a = {k: v.detach() for k, v in trainable(ours).items()}
    b = {k: v.detach() for k, v in trainable(theirs).items()}
    assert a.keys() == b.keys() and a
    moved = max(float((a[k] - before[k]).abs().max()) for k in a)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 100 * TOLERANCE  # the step changed the adapter
    assert gap <= TOLERANCE, (gap, moved)
    assert got.steps == own.steps == steps
    assert got.loss == pytest.approx(own.loss, rel=1e-5)


def test_an_algorithm_that_changes_the_loss_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="algorithm: fedprox changes the local loss"):
        HFTrainerTask.check_run(
            HFTrainerConfig(script=str(SCRIPT)),
            load_config(
                {
                    "name": "x",
                    "algorithm": "fedprox",
                    "task": {"kind": "hf_trainer", "script": str(SCRIPT)},
                }
            ),
        )


def test_the_example_runs_federated_through_the_command(tmp_path, monkeypatch, capsys):
    argv = [
        "run",
        str(REPO / "examples" / "hf_trainer.yaml"),
        f"out_dir={tmp_path}",
        "task.options.size=tiny",
        "task.options.per_domain=8",
        "task.options.max_length=64",
        f"task.script={SCRIPT}",
        "plots=false",
        "algo.server_opt.name=fedadam",
    ]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 0, err
    folder = tmp_path / "hf-trainer"
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients"] == 3 for r in rows[1:])
    # Only the adapter travels: q and v LoRA A and B of one layer, float32.
    adapter = 2 * (32 * 8 + 8 * 32) * 4
    assert rows[1]["bytes_up_arrays"] == 3 * adapter
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert "train_runtime" not in out + err  # the Trainer prints nothing of its own
    assert out.strip().splitlines()[-1].startswith("hf-trainer: loss=")


@pytest.mark.slow  # Ray's actors: a minute or more on a loaded machine
def test_the_example_on_flowers_simulation_equals_the_embedded_run(tmp_path):
    task = {"kind": "hf_trainer", "script": str(SCRIPT), "options": TINY}
    base = {"rounds": 1, "seed": 0, "task": task, "train": {"steps": 2}, "plots": False}
    run({**base, "name": "emb", "out_dir": str(tmp_path)}, progress=False)
    sim_cfg = {**base, "name": "sim", "out_dir": str(tmp_path), "runtime": "flower-sim"}
    opts = {"imports": ["fedfm.integrations"], "sim_cpus": 2, "node_wait_s": 600}
    run(sim_cfg, progress=False, options=opts)
    same_run(tmp_path / "emb", tmp_path / "sim")
