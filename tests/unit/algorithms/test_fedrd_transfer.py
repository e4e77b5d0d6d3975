"""FedRD's unlabelled transfer pool (beyond the paper) and its pseudo-label control.

Runs in the digits setting with the tiny foundation model of ``helpers.fedrd``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.tasks.public import used_ids
from helpers.fedrd import fedrd_config, same_state

pytestmark = pytest.mark.usefixtures("fedrd_fresh")


def test_pool_is_disjoint_from_clients_public_set_and_test_rows(tmp_path) -> None:
    algo = build(fedrd_config(tmp_path, transfer_size=120, detach_teacher=True)).algo
    srv = algo.server()
    pool = srv.pool.ids.numpy()
    assert len(pool) == 120 and len(np.unique(pool)) == 120
    for other in (used_ids(algo.task), srv.public.ids.numpy(), algo.task.test_data().ids.numpy()):
        assert not np.intersect1d(pool, other).size
    assert srv.pool_feats is not None and srv.pool_feats.shape == (120, 24)


def test_pool_step_trains_the_student_and_never_reads_the_pool_labels(tmp_path) -> None:
    runs = []
    for garble in (False, True):
        algo = build(
            fedrd_config(tmp_path, transfer_size=64, detach_teacher=True, transfer_loss="pseudo")
        ).algo
        srv = algo.server()
        if garble:  # labels the pool must not read
            srv.pool.y = torch.randint(0, 10, srv.pool.y.shape, generator=torch.Generator())
        before = {k: v.clone() for k, v in algo.params.items()}
        metrics = algo.co_train(1)
        assert metrics["transfer_steps"] == 3 and np.isfinite(metrics["transfer_loss"])
        assert not same_state(algo.params, before)
        runs.append(algo.params)
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], rtol=0, atol=0)


def test_kd_pool_differs_from_pseudo_labels_and_from_no_pool(tmp_path) -> None:
    params = {}
    for name, algo_cfg in {
        "none": {},
        "kd": {"transfer_size": 64},
        "pseudo": {"transfer_size": 64, "transfer_loss": "pseudo"},
    }.items():
        algo = build(fedrd_config(tmp_path, detach_teacher=True, **algo_cfg)).algo
        algo.co_train(1)
        params[name] = algo.params
    assert not same_state(params["kd"], params["none"])
    assert not same_state(params["kd"], params["pseudo"])


def test_pool_needs_a_teacher_path_and_free_rows(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        build(fedrd_config(tmp_path, "fedavg-ft", transfer_size=10))
    assert err.value.field == "algo.transfer_size"
    with pytest.raises(ConfigError) as err:
        build(fedrd_config(tmp_path, transfer_size=5000)).algo.server()
    assert err.value.field == "algo.transfer_size"
