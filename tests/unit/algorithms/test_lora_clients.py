"""Mixed LoRA ranks and FFA-LoRA in FedIT runs on a tiny Llama (three clients)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fedfm.algorithms.fedavg as fedavg_mod
from fedfm.config import load_config
from fedfm.core.aggregate import ReplySum
from fedfm.core.lora_ranks import A_SUFFIX, B_SUFFIX
from fedfm.errors import ConfigError
from fedfm.runtime import run
from helpers.bases import FEDSDR
from helpers.cli import run_cli
from helpers.config import make_config, write_yaml


def _cfg(tmp_path: Path, name: str, **lora) -> dict:
    cfg = make_config(FEDSDR, tmp_path, name=name, algorithm="fedavg", rounds=1)
    cfg["task"]["lora"] = {**cfg["task"]["lora"], **lora}
    return cfg


def _up_rows(folder: Path) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "audit.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train" and r["type"] == "arrays"]


@pytest.mark.parametrize("mode", ["svd", "hetlora", "zeropad"])
def test_mixed_ranks_send_each_clients_own_bytes(tmp_path, mode):
    cfg = _cfg(tmp_path, mode, client_ranks=[1, 2, 4], rank_mode=mode)
    cfg["algo"] = {"server_opt": {"name": "fedadam", "lr": 0.01}}
    summary = run(load_config(cfg), progress=False)
    rows = _up_rows(tmp_path / mode)
    by_client = {r["client"]: r["bytes"] for r in rows if r["direction"] == "up"}
    ranks = dict(zip(sorted(by_client), [1, 2, 4], strict=True))
    per_rank = {c: b / ranks[c] for c, b in by_client.items()}
    assert len(set(per_rank.values())) == 1  # bytes proportional to each client's rank
    down = {r["client"]: r["bytes"] for r in rows if r["direction"] == "down"}
    assert down == by_client  # each client receives its own rank too
    assert summary["final"]["clients"] == 3


def test_ffa_lora_sends_b_only_and_averages_the_bs_exactly(tmp_path, monkeypatch):
    sent: list[tuple[dict, int]] = []
    fold = ReplySum.fold

    def spy(acc, reply, field):
        sent.append(
            (
                {k: v.clone() for k, v in reply.arrays[field].items()},
                int(reply.meta["num_examples"]),
            )
        )
        fold(acc, reply, field)

    monkeypatch.setattr(ReplySum, "fold", spy)
    cfg = _cfg(tmp_path, "ffa", freeze_a=True)
    cfg["train"] = {**cfg["train"], "lr": 0.05}
    setup = fedfm_build(cfg)
    algo = setup.algo
    a0 = {k: v.clone() for k, v in algo.lora.frozen.items()}
    assert a0 and all(k.endswith(A_SUFFIX) for k in a0)
    assert all(k.endswith(B_SUFFIX) for k in algo.params)
    run(load_config(cfg), progress=False)
    assert len(sent) == 3 and all(set(s) == set(algo.params) for s, _ in sent)
    n = sum(w for _, w in sent)
    ckpt = _last_params(tmp_path / "ffa")
    for key in algo.params:
        mean = sum(s[key].double() * w for s, w in sent) / n
        torch.testing.assert_close(ckpt[key].double(), mean, atol=1e-7, rtol=0)
        assert float(ckpt[key].abs().sum()) > 0  # B trained
    # The B's share one A: the mean of the products is the product of the means.
    for key in algo.params:
        a = a0[key.replace(B_SUFFIX, A_SUFFIX)].double()
        prod = sum(s[key].double() @ a * w for s, w in sent) / n
        torch.testing.assert_close(ckpt[key].double() @ a, prod, atol=1e-7, rtol=0)


def fedfm_build(cfg: dict):
    from fedfm.engine import build

    return build(load_config(cfg))


def _last_params(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("checkpoints/**/*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return {k.removeprefix("params/"): v for k, v in state.items() if k.startswith("params/")}


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"client_ranks": [2, 8], "rank_mode": "svd"}, "task.lora.client_ranks"),
        ({"client_ranks": [2, 4], "freeze_a": True}, "task.lora.freeze_a"),
        ({"client_ranks": [2, 4], "rank_mode": "flora", "r": 7}, "task.lora.r"),
        ({"rank_mode": "svdx"}, "task.lora.rank_mode"),
    ],
)
def test_bad_lora_options_name_their_field(tmp_path, lora, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        fedfm_build(_cfg(tmp_path, "bad", **lora))


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"client_ranks": [2, 8]}, "task.lora.client_ranks"),  # above r=4 under re-projection
        ({"client_ranks": [2, 4], "freeze_a": True}, "task.lora.freeze_a"),
        ({"client_ranks": [2], "freeze_a": True}, "task.lora.freeze_a"),  # one rank, not r
    ],
)
def test_bad_rank_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys, lora, field):
    cfg = _cfg(tmp_path / "runs", "bad", **lora)
    path = write_yaml(tmp_path, cfg)
    code, out, err = run_cli(["run", str(path)], monkeypatch, capsys)
    assert code == 2 and field in err, err
    assert len((out + err).strip().splitlines()) == 1, out + err
    assert not (tmp_path / "runs").exists()


def test_other_algorithms_refuse_the_options(tmp_path):
    cfg = _cfg(tmp_path, "scaf", freeze_a=True)
    cfg["algorithm"] = "scaffold"
    with pytest.raises(ConfigError, match=r"task\.lora\.freeze_a"):
        fedfm_build(cfg)


def test_ffa_lora_keeps_a_frozen_in_training_and_composes_with_dp_fedavg(tmp_path, monkeypatch):
    trained_a: list[dict[str, torch.Tensor]] = []
    local = fedavg_mod.local_round

    def spy(ctx, model, cfg, **kw):
        out = local(ctx, model, cfg, **kw)
        state = ctx.task.get_params(model)
        trained_a.append({k: v.clone() for k, v in state.items() if k.endswith(A_SUFFIX)})
        return out

    monkeypatch.setattr(fedavg_mod, "local_round", spy)
    cfg = _cfg(tmp_path, "ffadp", freeze_a=True)
    cfg["privacy"] = {
        "noise": "seeded",
        "user_level": {"clip": 0.5, "noise_multiplier": 0.3, "min_clients": 3},
    }
    a0 = fedfm_build(cfg).algo.lora.frozen
    summary = run(load_config(cfg), progress=False)
    assert len(trained_a) == 3
    for a in trained_a:
        assert all(torch.equal(a[k], a0[k]) for k in a0)  # A never moved
    rows = [r for r in _up_rows(tmp_path / "ffadp") if r["direction"] == "up"]
    assert rows and all(r["privacy"] == "dp" for r in rows)
    assert "privacy" in summary


def _server_opts() -> list[str]:
    from fedfm.core.optim import SERVER_OPTIMIZERS

    return list(SERVER_OPTIMIZERS)


@pytest.mark.parametrize("opt", _server_opts())
def test_mixed_ranks_run_under_every_server_optimizer(tmp_path, opt):
    cfg = _cfg(tmp_path, opt, client_ranks=[2, 4], rank_mode="svd")
    cfg["algo"] = {"server_opt": {"name": opt}}
    summary = run(load_config(cfg), progress=False)
    assert summary["final"]["clients"] == 3 and summary["final"]["update_norm"] > 0


def test_mixed_ranks_run_under_fedprox(tmp_path):
    cfg = _cfg(tmp_path, "prox", client_ranks=[2, 4], rank_mode="hetlora")
    cfg.update(algorithm="fedprox", algo={"mu": 0.1})
    assert run(load_config(cfg), progress=False)["final"]["update_norm"] > 0


def test_flora_stacks_exactly_and_its_downlink_grows(tmp_path, monkeypatch):
    # FedAvg at lr 1 applies the stack as it is: after two rounds the global adapter holds
    # round 1's stack in components 0..6 and round 2's in 7..13, each exactly Σ p_k B_k A_k.
    sent: list[list[tuple[dict, int]]] = [[], []]
    stream = fedavg_mod.Federation.stream

    def spy(self, messages, like=None):
        for cid, r in stream(self, messages, like):
            sent[self.rnd - 1].append(
                ({k: v.clone() for k, v in r.arrays["params"].items()}, r.meta["num_examples"])
            )
            yield cid, r

    monkeypatch.setattr(fedavg_mod.Federation, "stream", spy)
    cfg = _cfg(tmp_path, "flora", client_ranks=[1, 2, 4], rank_mode="flora", r=16)
    cfg["rounds"] = 2
    run(load_config(cfg), progress=False)
    rows = _up_rows(tmp_path / "flora")
    down = {(r["round"], r["client"]): r["numel"] for r in rows if r["direction"] == "down"}
    assert all(down[(1, c)] == 0 for c in ("0", "1", "2"))  # nothing stacked yet
    assert len({down[(2, c)] for c in ("0", "1", "2")}) == 1 and down[(2, "0")] > 0
    ckpt = _last_params(tmp_path / "flora")
    for rnd, lo in ((0, 0), (1, 7)):
        n = sum(w for _, w in sent[rnd])
        for b_key in (k for k in ckpt if k.endswith(B_SUFFIX)):
            a_key = b_key.replace(B_SUFFIX, A_SUFFIX)
            got = ckpt[b_key][:, lo : lo + 7].double() @ ckpt[a_key][lo : lo + 7].double()
            want = sum(w / n * (s[b_key].double() @ s[a_key].double()) for s, w in sent[rnd])
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert float(ckpt[next(k for k in ckpt if k.endswith(B_SUFFIX))][:, 14:].abs().sum()) == 0


def test_ffa_lora_composes_with_dp_sgd_in_dpsyn(tmp_path, monkeypatch):
    from fedfm.fm import handle
    from helpers.bases import DPSYN

    seen: list[tuple[dict, dict]] = []
    dp_train = handle.FoundationModel.dp_train

    def spy(self, rows, state, what, **kw):
        before = self.get_adapter(what.trainable[0])
        res, out = dp_train(self, rows, state, what, **kw)
        seen.append((before, out))
        return res, out

    monkeypatch.setattr(handle.FoundationModel, "dp_train", spy)
    cfg = make_config(DPSYN, tmp_path, name="ffa-dpsgd", task__lora__freeze_a=True)
    run(load_config(cfg), progress=False)
    assert seen
    for before, out in seen:
        a_keys = [k for k in before if k.endswith(A_SUFFIX)]
        assert a_keys and all(torch.equal(before[k], out[k]) for k in a_keys)  # A not trained
        assert any(not torch.equal(before[k], out[k]) for k in out if k.endswith(B_SUFFIX))
    rows = [r for r in _up_rows(tmp_path / "ffa-dpsgd") if r["direction"] == "up"]
    b_numel = sum(v.numel() for k, v in seen[0][0].items() if k.endswith(B_SUFFIX))
    assert rows and all(r["numel"] == b_numel for r in rows)  # only B left the clients


def test_mixed_ranks_refuse_update_cosines(tmp_path):
    cfg = _cfg(tmp_path, "cos", client_ranks=[2, 4])
    cfg["algo"] = {"update_cosines": True}
    with pytest.raises(ConfigError, match=r"algo\.update_cosines"):
        fedfm_build(cfg)
