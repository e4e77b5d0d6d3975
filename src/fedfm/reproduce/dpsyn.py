"""DP federated text generation study (:mod:`fedfm.algorithms.dpsyn`, docs/dpsyn.md).

Do the weak clients' votes select better samples than chance?

Three generators (the base model, 1 and 4 strong clients of 20 with DP-SGD) stop once their
pool is saved; **offline voting** replays the weak clients' votes with the algorithm's own
functions over many seeds and several ε_vote and selects four ways (:data:`SELECTIONS`).
Choices of ours: the base pool is voted on by the weak clients of the fewest-strong
generator; the vote noise is seeded per (seed, ε, client); *top by votes* keeps each code's
quota (not ``rank``'s ``keep_fraction``), so all four selections share size and code mix.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.reproduce.framework import (
    Compute,
    Context,
    Job,
    Readout,
    Run,
    RunView,
    Unmet,
    merge,
    preset,
    register,
    resolved,
    task_of,
)
from fedfm.reproduce.stats import (
    IN_DIRECTION,
    NONE,
    Estimate,
    balanced_accuracy,
    balanced_weights,
    crossed,
    crossed_bootstrap,
    macro_f1,
    macro_f1_rows,
    mde_of,
    mean_se,
    paired,
    verdict,
)
from fedfm.reproduce.tables import DASH, Text, head, marked, num, row

TEXT = Text("dpsyn")
PRESET = "dpsyn-rotten-tomatoes"
EMBED = "embed"
PROBE = "prompts"
PILOT = "pilot"
EMBEDDINGS = "embeddings.npz"
PREDICTIONS = "predictions.npz"

# Selections of one pool: (key, what it is). "pool" is the whole pool, once.
SELECTIONS = (
    ("votes", "by votes, with replacement (the algorithm's resampling)"),
    ("uniform", "uniform, with replacement (the duplication-matched control)"),
    ("top", "top by votes (distinct)"),
    ("subset", "uniform, without replacement (no voting)"),
)
VOTED = ("votes", "top")  # the selections that read the votes (one per ε)


# The main grid's DP-SGD at ε_train 8 (the pilot keeps the earlier AdamW lr 2e-3 on LoRA r 8 of
# q, k, v, o: its configs must not change under a running pilot). Chosen by
# benchmarks/dpsyn_dp_signal.py on SmolLM2 and the study's rows (32 examples, at init):
# - The earlier DP-SGD learnt nothing: on 0.92 M LoRA coordinates (A gets no gradient while
#   B = 0, only noise) a step's noise σ·C/B·√d is 0.57 · 1/32 · 960 ≈ 17, against a clipped mean
#   gradient of about 0.25 (B's, at C 1); signal over noise after its 15 steps,
#   √T·‖E clip g‖ / (σ·C·√d/B), is about 0.06 (0.09 with B's coordinates alone, clipped at their
#   median norm 1.54), and AdamW turns each coordinate's noise into a step of size lr.
# - FFA-LoRA rank 1 on v_proj (A frozen, d = 5,760 B coordinates) keeps most of the signal:
#   median per-example norm 0.43, coherence ‖E clip g‖ / E‖clip g‖ 0.29 (0.27 for rank 8 of q,
#   k, v, o). At expected batch 64 of 500 rows and 15 steps the planner gives σ 0.70 and signal
#   over noise 1.24 for one client (2.5 averaged over four); batch 128 would give 1.86 at four
#   times the earlier compute (the 4-strong generator alone would pass 90 minutes), batch 32
#   0.76, rank 1 of q, k, v, o at batch 64 0.40.
# - Along the clipped mean gradient alone, B = −η·ḡ lowers the NLL of 32 other rows by 0.21 ±
#   0.04 nats at η 30 (‖ḡ‖ 0.13 at C 0.43), so rank 1 can move the LM; SGD with momentum 0.9 at
#   lr 0.5 moves about 13·lr·ḡ per round of 5 steps, 39·lr in three.
# - A first round in real DP-SGD (fedfm's dp_train, 5 steps, two strong clients, expected batch
#   16 with σ 0.175: the noise per averaged gradient, σ·C/B, of this plan's σ 0.70 at batch 64;
#   its own ε is not 8) moved each client's B by 1.29 and 1.43, their mean by 1.11: 1-strong ÷
#   2-strong 1.22 (noise alone √2 = 1.41, a shared signal 1). Held-out reference NLL (60 real
#   test reviews, the study's prompt): 1 strong − base −0.082 ± 0.005, 2 strong − 1 strong
#   −0.007 ± 0.002 (paired over reviews; one draw of the DP noise).
DP_FINETUNE: dict[str, Any] = {
    "train": {"steps": 5, "batch_size": 64, "optimizer": "sgd", "momentum": 0.9, "lr": 0.5},
    "algo": {"max_grad_norm": 0.4},
    "task": {
        "lora": {
            "r": 1,
            "alpha": 2.0,
            "dropout": 0.0,
            "freeze_a": True,
            "target_modules": ["v_proj"],
        }
    },
}


@dataclass(frozen=True)
class Grid:
    """The study's sizes.

    Attributes:
        clients, rows: Clients (IID over Rotten Tomatoes) and rows of each.
        strong: Strong clients of the fine-tuned generators (the base model is the third).
        epsilon_train, train_rounds, steps, batch_size, lr: The strong clients' fine-tuning as
            the premise pilot runs it (at ε_train = ∞): its ε in the main grid, rounds, steps
            per round, expected Poisson batch and AdamW learning rate on ``task.lora``.
        dp_finetune: Config fields the main grid's fine-tuned generators take over the pilot's
            (:func:`main_config`): the DP-SGD that can learn at ε_train (:data:`DP_FINETUNE`).
        pool, size: Samples each generator generates, and each selection keeps.
        max_new_tokens, max_length, max_prompt_length: Tokens per review, per training row
            and of the prompt (its chat template included).
        prompt_template, probe_templates, probe_samples: The prompt of a code; the prompts
            the base model is tried with first (the preset's, the chosen one, a descriptive
            one naming what the codes mean), with samples per code.
        k, threshold: Votes per private sample; ``H`` subtracted from the summed votes.
        epsilon_votes, seeds: ε_vote values and seeds of the offline voting.
        seed: The runs' seed (partition, roles, generation).
        test_rows, bootstrap: Real test rows (None: all); resamples of macro-F1's bootstrap.
        task, algo: Fields replacing the preset's (a tiny model in tests).
        label: Which grid it is, for the report's title.
        gated: Whether the main grid's generators wait for the premise pilot to hold (False:
            they run whatever it shows, e.g. to time the whole grid at a tiny size).
    """

    clients: int = 20
    rows: int = 500
    strong: tuple[int, ...] = (1, 4)
    epsilon_train: float = 8.0
    train_rounds: int = 3
    steps: int = 5
    batch_size: int = 32
    lr: float = 2e-3
    dp_finetune: Mapping[str, Any] = field(default_factory=lambda: copy.deepcopy(DP_FINETUNE))
    pool: int = 300
    size: int = 150
    max_new_tokens: int = 40
    max_length: int = 128
    max_prompt_length: int = 80
    prompt_template: str = "Write a one-sentence {code} movie review."
    probe_templates: tuple[str, ...] = (
        "Write a {code} movie review.",
        "Write a one-sentence {code} movie review.",
        "Write a {code} movie review in one sentence (on Rotten Tomatoes, a rotten review is"
        " negative: the critic disliked the film; a fresh review is positive: the critic"
        " liked it).",
    )
    probe_samples: int = 16
    k: int = 8
    threshold: float = 0.0
    epsilon_votes: tuple[float, ...] = (1.0, 4.0)
    seeds: int = 20
    seed: int = 0
    test_rows: int | None = None
    bootstrap: int = 1000
    task: Mapping[str, Any] = field(default_factory=dict)
    algo: Mapping[str, Any] = field(default_factory=dict)
    label: str = "full grid"
    gated: bool = True

    @property
    def generators(self) -> tuple[int, ...]:
        """Strong clients of each generator, the base model (0) first."""
        return (0, *self.strong)

    @property
    def few(self) -> int:
        """The fewest strong clients (whose weak clients also vote on the base pool)."""
        return min(self.strong)

    @property
    def many(self) -> int:
        """The most strong clients."""
        return max(self.strong)


# Sized from measured runs on this machine (docs/dpsyn.md, "Reproduction"): 0.85 CPU seconds
# per generated sample on one thread; the earlier DP-SGD (r 8 on q, k, v, o) cost 19 to 40 CPU
# seconds per step of batch 32 (the 4-strong generator 43.9 CPU minutes in all). The main grid's
# DP-SGD passes each client's examples twice as often (15 steps of 64, 3,840 per-example passes
# for 4 strong), at 0.50 and 0.63 CPU seconds a pass (benchmarks/dpsyn_dp_signal.py train, 80
# DP-SGD passes of each of two clients, load 17 to 36): 32 to 40 CPU minutes of DP-SGD and 4 of
# generation on one worker, the rest of the main grid on the other; the pilot (`--pilot`) is a
# command of its own. Not yet timed as a whole grid.
FULL = Grid()
QUICK = Grid(
    rows=250,
    train_rounds=1,
    pool=150,
    size=75,
    seeds=10,
    test_rows=1000,
    probe_samples=8,
    label="quick grid",
)


def pool_name(strong: int) -> str:
    """The generator run of ``strong`` strong clients: ``base``, ``strong1``, ``strong4``."""
    return "base" if strong == 0 else f"strong{strong}"


def vote_name(strong: int) -> str:
    """The offline voting job of a pool."""
    return f"vote-{pool_name(strong)}"


def strong_fraction(grid: Grid, strong: int) -> float:
    """``clients.roles.strong`` of ``strong`` clients (the base model: the fewest's roles).

    Half a client above the count, so that ``floor(fraction · clients)`` is the count.
    """
    return (max(strong, grid.few) + 0.5) / grid.clients


def voters(grid: Grid, strong: int) -> list[str]:
    """The weak clients of a generator's federation (the roles every process computes)."""
    from fedfm.core.federation import assign_roles

    cids = [str(i) for i in range(grid.clients)]
    roles = assign_roles(cids, {"strong": strong_fraction(grid, strong)}, grid.seed)
    return [c.cid for c in roles if c.role != "strong"]


def generator_config(grid: Grid, strong: int) -> dict[str, Any]:
    """The run config of a generator: it stops once its pool is generated and saved."""
    cfg = preset(PRESET)
    rounds = grid.train_rounds if strong else 0
    cfg.update(seed=grid.seed, rounds=rounds + 1, plots=False, eval_before=False, eval_every=1)
    algo = cfg["algo"]
    algo.update(
        train_rounds=rounds,
        epsilon_train=grid.epsilon_train,
        num_samples=grid.pool,
        resample_size=grid.size,
        k=grid.k,
        vote_threshold=grid.threshold,
        prompt_template=grid.prompt_template,
        physical_batch_size=min(grid.batch_size, 16),
        eval={"enabled": False, "embedder": None},
    )
    algo["generation"]["max_new_tokens"] = grid.max_new_tokens
    task = cfg["task"]
    task.update(max_train=grid.rows * grid.clients, max_test=grid.test_rows)
    task["prompt"] = {"max_length": grid.max_length, "max_prompt_length": grid.max_prompt_length}
    cfg["partition"] = {"scheme": "iid", "num_clients": grid.clients}
    cfg["clients"] = {"roles": {"strong": strong_fraction(grid, strong)}}
    cfg["train"].update(steps=grid.steps, batch_size=grid.batch_size, lr=grid.lr)
    cfg["task"], cfg["algo"] = merge(task, grid.task), merge(algo, grid.algo)
    return cfg


def main_config(grid: Grid, strong: int) -> dict[str, Any]:
    """A main-grid generator: :func:`generator_config` with ``grid.dp_finetune`` over it.

    The base model (``strong = 0``) trains nothing and keeps :func:`generator_config`.
    """
    cfg = generator_config(grid, strong)
    return merge(cfg, grid.dp_finetune) if strong else cfg


def pilot_name(strong: int) -> str:
    """The pilot generator of ``strong`` strong clients without DP: ``pilot-strong1``."""
    return f"pilot-{pool_name(strong)}"


def pilot_config(grid: Grid, strong: int) -> dict[str, Any]:
    """A pilot generator: the grid's generator without DP.

    The grid's generator of ``strong`` strong clients at ε_train = ∞ (no clipping, no noise),
    everything else the same.
    """
    cfg = generator_config(grid, strong)
    cfg["algo"]["epsilon_train"] = "inf"
    return cfg


def pilot_jobs(grid: Grid) -> list[Job]:
    """The premise pilot and the check that gates the main grid.

    The premise pilot: the fewest and the most strong clients fine-tuned without DP, their
    pools scored without voting (uniform subsets), and the check that gates the main grid.
    """
    order = sorted({grid.few, grid.many}, reverse=True)
    out: list[Job] = [Run(pilot_name(s), pilot_config(grid, s), group="pilot") for s in order]
    out.append(Compute(EMBED, embed_real, {"config": generator_config(grid, 0)}, group="embed"))
    for s in order:
        params = {"voters": voters(grid, s), "epsilon_votes": [], "seeds": grid.seeds}
        needs: tuple[str, ...] = (pilot_name(s), EMBED)
        out.append(
            Compute(
                f"vote-{pilot_name(s)}", vote_offline, {**params, "size": grid.size}, needs, "vote"
            )
        )
    needs = (EMBED, *(f"vote-{pilot_name(s)}" for s in order), *map(pilot_name, order))
    params = {"few": grid.few, "many": grid.many, "rounds": grid.train_rounds}
    out.append(Compute(PILOT, judge_pilot, params, needs, "pilot-check"))
    return out


def judge_pilot(
    inputs: Mapping[str, Path], folder: Path, few: int, many: int, rounds: int
) -> dict[str, Any]:
    """The premise at ε_train = ∞.

    ``many`` strong clients' pool against ``few``'s without voting (uniform subsets, the same
    seeds), by balanced accuracy paired over seeds × test rows; each pool's accuracy, balanced
    accuracy and macro-F1; the runs' update norms.
    """
    with np.load(inputs[EMBED] / EMBEDDINGS) as z:
        y = np.asarray(z["test/y"])
    w = balanced_weights(y.tolist())
    pools: dict[str, Any] = {}
    hits: dict[int, np.ndarray] = {}
    for s in (few, many):
        with np.load(inputs[f"vote-{pilot_name(s)}"] / PREDICTIONS) as z:
            pred = np.asarray(z["subset"])
        hits[s] = (pred == y[None, :]).astype(float) * w[None, :]
        view = RunView(inputs[pilot_name(s)])
        norms = [view.rounds.get(i, {}).get("update_norm") for i in range(1, rounds + 1)]
        pools[str(s)] = {
            "accuracy": mean_se([float(np.mean(p == y)) for p in pred]).__dict__,
            "balanced": mean_se([balanced_accuracy(y, p) for p in pred]).__dict__,
            "macro_f1": mean_se([macro_f1(y, p) for p in pred]).__dict__,
            "update_norms": norms,
        }
    n = min(len(hits[few]), len(hits[many]))
    est = crossed(hits[many][:n] - hits[few][:n])
    holds = verdict(est, +1) == IN_DIRECTION
    first = [pools[str(s)]["update_norms"][0] for s in (many, few)]
    norm_ratio = first[0] / first[1] if all(first) else math.nan
    return {
        "difference": est.__dict__,
        "mde": mde_of(est),
        "holds": holds,
        "pools": pools,
        "test_labels": np.bincount(y).tolist(),
        "norm_ratio": norm_ratio,
    }


def _pilot_holds(grid: Grid, strong: int, needs: Mapping[str, RunView]) -> dict[str, Any]:
    """The main generator's config, once the pilot showed its premise (else :class:`Unmet`)."""
    got = needs[PILOT].result
    if grid.gated and (not got or not got["holds"]):
        est = Estimate(**got["difference"]).fmt() if got else "not measured"
        raise Unmet(
            f"the pilot (ε_train = ∞) does not show {grid.many} strong clients above"
            f" {grid.few} without voting ({est}): the claim cannot be tested at this scale"
        )
    return main_config(grid, strong)


def jobs(ctx: Context[Grid]) -> list[Job]:
    """The pilot first (:func:`pilot_jobs`).

    Then, where it holds, the generators (the longest first, so that two workers start it at once),
    one offline voting per pool.
    """
    grid = ctx.grid
    out = pilot_jobs(grid)
    if ctx.pilot:
        return out
    order = sorted(grid.generators, reverse=True)
    out += [
        Run(
            pool_name(s),
            partial(_pilot_holds, grid, s),
            (PILOT,),
            "generate" if s == 0 else "fine-tune",
        )
        for s in order
    ]
    base = generator_config(grid, 0)
    probe = {"config": base, "templates": list(grid.probe_templates)}
    out.append(
        Compute(PROBE, probe_prompts, {**probe, "per_code": grid.probe_samples}, (EMBED,), "probe")
    )
    for s in order:
        params = {"voters": voters(grid, s), "epsilon_votes": list(grid.epsilon_votes)}
        params.update(seeds=grid.seeds, size=grid.size)
        out.append(Compute(vote_name(s), vote_offline, params, (pool_name(s), EMBED), "vote"))
    return out


def embed_real(
    inputs: Mapping[str, Path], folder: Path, config: Mapping[str, Any]
) -> dict[str, Any]:
    """Embeds the clients' and the test rows once and measures the instrument on real data.

    Embeds every client's training rows and the real test rows once (``embeddings.npz``)
    and measures the instrument on real data: the test labels, the majority baseline and
    the ceiling (the classifier trained on every client's real rows).
    """
    from fedfm.eval.synthetic import frechet_distance, logreg_predict, scores
    from fedfm.models.encoders import text_embedder

    t0 = time.perf_counter()
    task = task_of(config)
    embed = text_embedder(str(config["algo"]["embedder"]))
    arrays: dict[str, Any] = {}
    for cid in task.client_ids():
        data = task.client_data(cid)
        arrays[f"emb/{cid}"] = np.asarray(embed(task.texts(data)), np.float32)
        arrays[f"code/{cid}"] = task.code_ids(data).numpy()
        arrays[f"y/{cid}"] = data.y.numpy()
    test = task.test_data()
    arrays["test/emb"] = np.asarray(embed(task.texts(test)), np.float32)
    arrays["test/y"], arrays["test/id"] = test.y.numpy(), test.ids.numpy()
    train_x = np.concatenate([arrays[f"emb/{c}"] for c in task.client_ids()])
    train_y = np.concatenate([arrays[f"y/{c}"] for c in task.client_ids()])
    arrays["ceiling/pred"] = logreg_predict(train_x, train_y, arrays["test/emb"])
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / EMBEDDINGS, **arrays)
    y = arrays["test/y"]
    counts = np.bincount(y, minlength=task.num_classes)
    rng = np.random.default_rng(0)
    sample = train_x[rng.choice(len(train_x), min(len(train_x), 2 * len(y)), replace=False)]
    return {
        "codes": task.codes(),
        "code_labels": task.code_labels(),
        "class_names": list(task.src.class_names or []),
        "clients": len(task.client_ids()),
        "train_rows": len(train_y),
        "test_rows": len(y),
        "test_labels": counts.tolist(),
        "majority": float(counts.max() / counts.sum()),
        "ceiling": scores(arrays["ceiling/pred"], y),
        "frechet_real": frechet_distance(sample, arrays["test/emb"]),
        "seconds": time.perf_counter() - t0,
    }


def ceiling_agrees(emb: Mapping[str, np.ndarray], x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Whether the ceiling classifier predicts each sample's own label.

    ``(P,)`` whether the ceiling (logistic regression on every client's real rows, from
    ``embeddings.npz``) predicts each sample's own label: does the text read as its code?
    """
    from fedfm.eval.synthetic import logreg_predict

    ids = sorted((k.split("/", 1)[1] for k in emb if k.startswith("emb/")), key=int)
    real_x = np.concatenate([emb[f"emb/{c}"] for c in ids])
    real_y = np.concatenate([emb[f"y/{c}"] for c in ids])
    return np.asarray(logreg_predict(real_x, real_y, x) == labels)


def probe_prompts(
    inputs: Mapping[str, Path],
    folder: Path,
    config: Mapping[str, Any],
    templates: Sequence[str],
    per_code: int,
) -> dict[str, Any]:
    """The base model tried with each prompt template: on-code share, cuts, examples."""
    from fedfm.core.seeding import derive_seed
    from fedfm.models.encoders import text_embedder
    from fedfm.models.generation import GenerationConfig

    t0 = time.perf_counter()
    task = task_of(config)
    fm, labels = task.foundation_model(), task.code_labels()
    gen = GenerationConfig(**config["algo"]["generation"])
    emb = dict(np.load(inputs[EMBED] / EMBEDDINGS))
    embed = text_embedder(str(config["algo"]["embedder"]))
    out: dict[str, Any] = {}
    for template in templates:
        texts, ys, cut, examples, whole = [], [], [], {}, True
        for j, code in enumerate(task.codes()):
            instruction = template.format(code=code)
            prompt = fm.instruction_prompt(instruction)
            whole = whole and instruction in prompt
            seed = derive_seed(config["seed"], "probe", template, j)
            replies = fm.generate_replies([prompt] * per_code, [], seed=seed, cfg=gen)
            texts += [r.text for r in replies]
            ys += [labels[j]] * per_code
            cut += [r.truncated for r in replies]
            examples[code] = [r.text for r in replies[:2]]
        agree = ceiling_agrees(emb, np.asarray(embed(texts)), np.asarray(ys))
        out[template] = {
            "on_code": mean_se(agree.astype(float).tolist()).__dict__,
            "truncated": float(np.mean(cut)),
            "prompt_whole": whole,
            "words": float(np.mean([len(t.split()) for t in texts])),
            "examples": examples,
        }
    return {"templates": out, "per_code": per_code, "seconds": time.perf_counter() - t0}


@dataclass
class _Pool:
    """A saved pool with what the offline voting reads of it."""

    rows: list[dict[str, Any]]
    codes: np.ndarray  # (P,) code ids
    labels: np.ndarray  # (P,) class labels
    allotment: list[int]
    config: dict[str, Any]
    privacy: dict[str, Any]


def _read_pool(run: Path) -> _Pool:
    text = (run / "artefacts" / "synthetic_initial.jsonl").read_text()
    rows = [json.loads(x) for x in text.split("\n") if x]
    profile = json.loads((run / "artefacts" / "profile.json").read_text())
    view = RunView(run)
    return _Pool(
        rows,
        np.asarray([r["code_id"] for r in rows], np.int64),
        np.asarray([r["label"] for r in rows], np.int64),
        [int(x) for x in profile["allotment"]],
        view.config,
        view.privacy,
    )


def clean_votes(
    emb: Mapping[str, np.ndarray],
    pool_emb: np.ndarray,
    pool_codes: np.ndarray,
    k: int,
    voter_ids: Sequence[str],
) -> dict[str, np.ndarray]:
    """Each voter's vote histogram before noise (``knn_votes`` of its rows), by client id."""
    from fedfm.algorithms.dpsyn_mechanisms import knn_votes

    return {
        c: knn_votes(emb[f"emb/{c}"], emb[f"code/{c}"], pool_emb, pool_codes, k) for c in voter_ids
    }


def noisy_total(
    clean: Mapping[str, np.ndarray], sigma: float, seeds: Mapping[str, int], threshold: float
) -> np.ndarray:
    """The server's clipped sum of the voters' noisy histograms.

    The server's clipped sum of the voters' noisy histograms, as the algorithm's vote
    round computes it (each client's :func:`~fedfm.algorithms.dpsyn_mechanisms.noisy`, summed in
    client order, then :func:`~fedfm.algorithms.dpsyn_mechanisms.clip_votes`).
    """
    import torch

    from fedfm.algorithms.dpsyn_mechanisms import clip_votes, noisy

    total = np.zeros(len(next(iter(clean.values()))), dtype=np.float64)
    for cid, votes in clean.items():
        total += noisy(torch.as_tensor(votes), sigma, seeds[cid]).numpy()
    return clip_votes(total, threshold)


def selections(
    votes: np.ndarray | None,
    codes: np.ndarray,
    allotment: list[int],
    size: int,
    rng: np.random.Generator,
    kind: str,
) -> list[int]:
    """``size`` samples per code as the algorithm allots them.

    ``kind`` ``votes`` (in proportion, with replacement), ``top``, ``uniform`` (with replacement) or
    ``subset``.
    """
    from fedfm.algorithms.dpsyn_mechanisms import draw_by_votes, quotas, top_by_votes

    ones = np.ones(len(codes))
    kept: list[int] = []
    for idx, want in quotas(codes, allotment, size):
        if not len(idx):
            continue
        if kind == "top":
            assert votes is not None
            kept += top_by_votes(votes, idx, min(want, len(idx)))
        elif kind == "votes":
            assert votes is not None
            kept += draw_by_votes(votes, idx, want, rng)
        else:
            replace = kind == "uniform"
            kept += draw_by_votes(ones, idx, want if replace else min(want, len(idx)), rng, replace)
    return kept


def vote_offline(
    inputs: Mapping[str, Path],
    folder: Path,
    voters: Sequence[str],
    epsilon_votes: Sequence[float],
    seeds: int,
    size: int,
) -> dict[str, Any]:
    """Votes on a saved pool offline, selects samples four ways and scores each selection.

    Votes on a saved pool (``inputs``: the generator run and ``embed``) offline by the weak
    clients ``voters`` over ``seeds`` draws at each ε_vote, selects ``size`` samples four ways
    and scores every selection on the real test rows (predictions in ``predictions.npz``).
    """
    from fedfm.core.privacy import analytic_gaussian_sigma
    from fedfm.core.seeding import derive_seed
    from fedfm.eval.synthetic import frechet_distance, logreg_predict
    from fedfm.models.encoders import text_embedder

    t0 = time.perf_counter()
    run = next(p for n, p in inputs.items() if n != EMBED)
    pool = _read_pool(run)
    emb = dict(np.load(inputs[EMBED] / EMBEDDINGS))
    algo, privacy_cfg = pool.config["algo"], pool.config["privacy"]
    delta = float(algo["delta"] if algo.get("delta") is not None else privacy_cfg["delta"])
    pool_emb = np.asarray(text_embedder(str(algo["embedder"]))([r["text"] for r in pool.rows]))
    test_x = emb["test/emb"]
    clean = clean_votes(emb, pool_emb, pool.codes, int(algo["k"]), voters)
    threshold = float(algo["vote_threshold"])
    on_code = ceiling_agrees(emb, pool_emb, pool.labels)  # (P,)

    preds: dict[str, list[np.ndarray]] = {}
    stats: dict[str, dict[str, list[float]]] = {}

    def score(key: str, kept: list[int]) -> None:
        pred = logreg_predict(pool_emb[kept], pool.labels[kept], test_x)
        preds.setdefault(key, []).append(pred.astype(np.int8))
        distinct = sorted(set(kept))
        st = stats.setdefault(key, {"distinct": [], "frechet": [], "on_code": []})
        st["distinct"].append(len(distinct))
        fd = frechet_distance(pool_emb[distinct], test_x) if len(distinct) > 1 else math.nan
        st["frechet"].append(fd)
        st["on_code"].append(float(on_code[kept].mean()))

    score("pool", list(range(len(pool.rows))))
    run_seed = int(pool.config["seed"])
    for s in range(seeds):
        for kind in ("uniform", "subset"):
            rng = np.random.default_rng(derive_seed(run_seed, "offline", kind, s))
            score(kind, selections(None, pool.codes, pool.allotment, size, rng, kind))
        for eps in epsilon_votes:
            sigma = analytic_gaussian_sigma(float(eps), delta)
            noise = {c: derive_seed(run_seed, "offline-vote-noise", eps, s, c) for c in voters}
            total = noisy_total(clean, sigma, noise, threshold)
            for kind in VOTED:
                rng = np.random.default_rng(derive_seed(run_seed, "offline", kind, eps, s))
                kept = selections(total, pool.codes, pool.allotment, size, rng, kind)
                score(f"{kind}/{eps:g}", kept)
    folder.mkdir(parents=True, exist_ok=True)
    stacked: dict[str, Any] = {k: np.stack(v) for k, v in preds.items()}
    np.savez_compressed(folder / PREDICTIONS, **stacked)
    # The votes' signal (their spread over the pool's entries) against the noise's scale.
    mass = np.sum(list(clean.values()), axis=0)  # (P,) the votes before noise
    sigmas = {f"{e:g}": analytic_gaussian_sigma(float(e), delta) for e in epsilon_votes}
    signal = {
        "voters": len(voters),
        "private_samples": sum(len(emb[f"code/{c}"]) for c in voters),
        "k": int(algo["k"]),
        "mass_mean": float(mass.mean()),
        "mass_sd": float(mass.std(ddof=1)) if len(mass) > 1 else math.nan,
        "mass_max": float(mass.max()),
        "zero_share": float(np.mean(mass == 0)),
        "noise_sd": {e: sigma * math.sqrt(len(voters)) for e, sigma in sigmas.items()},
    }
    hit = on_code.astype(float)
    varied = len(mass) > 1 and mass.std() > 0 and hit.std() > 0
    return {
        "pool": _describe(pool, on_code),
        "signal": signal,
        "correlation_votes_on_code": float(np.corrcoef(mass, hit)[0, 1]) if varied else math.nan,
        "selections": stats,
        "privacy": _privacy(pool, voters, epsilon_votes, delta),
        "voters": list(voters),
        "seconds": time.perf_counter() - t0,
    }


def _describe(pool: _Pool, on_code: np.ndarray) -> dict[str, Any]:
    texts = [str(r["text"]) for r in pool.rows]
    by_code: dict[str, list[str]] = {}
    for r in pool.rows:
        by_code.setdefault(str(r["code"]), []).append(str(r["text"]))
    return {
        "samples": len(texts),
        "distinct_texts": len(set(texts)),
        "per_code": {c: len(v) for c, v in by_code.items()},
        "allotment": pool.allotment,
        "truncated": float(np.mean([bool(r.get("truncated", False)) for r in pool.rows])),
        "empty": sum(not t.strip() for t in texts),
        "words": float(np.mean([len(t.split()) for t in texts])),
        "on_code": float(on_code.mean()),
        "examples": {c: v[:3] for c, v in by_code.items()},
    }


def _privacy(
    pool: _Pool, voter_ids: Sequence[str], epsilon_votes: Sequence[float], delta: float
) -> dict[str, Any]:
    """Composed ε per role: the run's ledger (profiling, DP-SGD) plus the offline vote."""
    from fedfm.core.privacy import PrivacyLedger, analytic_gaussian_sigma

    out: dict[str, Any] = {}
    pc = pool.config["privacy"]
    for eps in epsilon_votes:
        ledger = PrivacyLedger(float(pc["delta"]), pc["accountant"], pc["noise"])
        ledger.load_state(list(pool.privacy.get("entries", [])))
        sigma = analytic_gaussian_sigma(float(eps), delta)
        for c in voter_ids:
            ledger.add_gaussian(c, sigma, 1.0, name="vote", analytic=True)
        rep = ledger.report()
        weak = [rep["clients"][c]["epsilon"] for c in voter_ids if c in rep["clients"]]
        strong = [v["epsilon"] for c, v in rep["clients"].items() if c not in voter_ids]
        out[f"{eps:g}"] = {
            "mechanisms": {k: v["epsilon_max"] for k, v in rep["mechanisms"].items()},
            "weak": max(weak) if weak else math.nan,
            "strong": max(strong) if strong else math.nan,
            "sigma_vote": sigma,
        }
    return out


Side = tuple[int, str]  # (strong clients of the pool, selection key)


@dataclass
class Results:
    """What the report reads.

    What the report reads: the ``embed`` and ``probe`` results (None before they ran), the
    test labels ``y``, by a pool's strong clients its offline ``votes``, its ``preds``
    (selection key -> ``(seeds, N)`` test predictions) and its finished generator run.
    """

    grid: Grid
    pilot: dict[str, Any] | None = None
    embed: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    y: np.ndarray | None = None
    votes: dict[int, dict[str, Any]] = field(default_factory=dict)
    preds: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    runs: dict[int, RunView] = field(default_factory=dict)

    def pred(self, side: Side) -> np.ndarray | None:
        """``(seeds, N)`` predictions of one selection's classifiers (``None`` when missing)."""
        return self.preds.get(side[0], {}).get(side[1])

    def correct(self, strong: int, key: str) -> np.ndarray | None:
        """``(seeds, N)`` correctness of one selection's classifiers (``None`` when missing)."""
        p = self.pred((strong, key))
        return None if p is None or self.y is None else (p == self.y[None, :]).astype(float)


def read(ctx: Context[Grid]) -> Results:
    """The finished generators, the embedding's result and every offline voting."""
    res = Results(ctx.grid, pilot=ctx.run(PILOT).result, probe=ctx.run(PROBE).result)
    emb = ctx.run(EMBED).result
    if emb is not None:
        res.embed = emb
        with np.load(ctx.out / EMBED / EMBEDDINGS) as z:
            res.y = np.asarray(z["test/y"])
    for s in ctx.grid.generators:
        view = ctx.run(pool_name(s))
        if view.finished:
            res.runs[s] = view
        vote = ctx.run(vote_name(s)).result
        if vote is not None and (ctx.out / vote_name(s) / PREDICTIONS).exists():
            res.votes[s] = vote
            with np.load(ctx.out / vote_name(s) / PREDICTIONS) as z:
                res.preds[s] = {k: np.asarray(z[k]) for k in z.files}
    return res


def acc_diff(res: Results, a: Side, b: Side) -> Estimate:
    """Accuracy of selection ``a`` minus ``b`` over seeds × test rows (two-way SE)."""
    ca, cb = res.correct(*a), res.correct(*b)
    if ca is None or cb is None or a == b:
        return NONE
    s = min(len(ca), len(cb))
    return crossed(ca[:s] - cb[:s])


def acc_level(res: Results, a: Side) -> Estimate:
    """Accuracy of one selection, with the two-way SE over its seeds and the test rows."""
    ca = res.correct(*a)
    return NONE if ca is None else crossed(ca)


def f1_diff(res: Results, a: Side, b: Side, seed: int = 0) -> Estimate:
    """Macro-F1 of ``a`` minus ``b``, averaged over seeds (two-way bootstrap SE)."""
    pa, pb = res.pred(a), res.pred(b)
    if pa is None or pb is None or res.y is None or a == b:
        return NONE
    s, y = min(len(pa), len(pb)), res.y

    def diff(si: np.ndarray, ri: np.ndarray) -> float:
        fa = macro_f1_rows(pa[si][:, ri], y[ri])
        fb = macro_f1_rows(pb[si][:, ri], y[ri])
        return float(np.mean(fa - fb))

    return crossed_bootstrap((s, len(y)), diff, res.grid.bootstrap, seed)


def f1_level(res: Results, a: Side) -> Estimate:
    """Macro-F1 of one selection: mean and SE over its seeds."""
    p = res.pred(a)
    if p is None or res.y is None:
        return NONE
    return mean_se(macro_f1_rows(p, res.y).tolist())


def predicted(res: Results, a: Side, classes: int) -> list[float]:
    """The share of test rows predicted as each class, averaged over seeds."""
    p = res.pred(a)
    if p is None or not classes:
        return []
    shares = [np.bincount(r.astype(np.int64), minlength=classes) / len(r) for r in p]
    return [float(x) for x in np.mean(shares, axis=0)]


def seed_values(res: Results, a: Side, what: str) -> list[float]:
    """A per-seed value of one selection (``frechet``, ``distinct``, ``on_code``)."""
    sel = res.votes.get(a[0], {}).get("selections", {}).get(a[1], {})
    return [float(x) for x in sel.get(what, [])]


def seed_diff(res: Results, a: Side, b: Side, what: str) -> Estimate:
    """A per-seed value of ``a`` minus ``b``, mean and SE over seeds (paired by index)."""
    va, vb = (dict(enumerate(seed_values(res, x, what))) for x in (a, b))
    return paired(va, vb)


STAT = "paired over seeds × test rows (two-way SE)"


def pool_label(strong: int) -> str:
    """``the base model's pool``, ``the 1-strong pool``."""
    return "the base model's pool" if strong == 0 else f"the {strong}-strong pool"


def readouts(grid: Grid) -> list[Readout[Results]]:
    """Voting against its control per pool and ε_vote, the first claim's premise and claim."""
    few, many = grid.few, grid.many
    size = f"{grid.size} of {grid.pool}"

    def acc(name: str, paper: str, a: Side, b: Side, scope: str, **kw: Any) -> Readout[Results]:
        return Readout(name, STAT, paper, +1, partial(acc_diff, a=a, b=b), scope=scope, **kw)

    def pilot(r: Results) -> Estimate:
        return NONE if r.pilot is None else Estimate(**r.pilot["difference"])

    out: list[Readout[Results]] = [
        Readout(
            f"pilot: {many} strong − {few} strong at ε_train = ∞, without voting (uniform"
            f" {size}, without replacement), balanced accuracy",
            STAT,
            "more strong clients help (the premise every claim rests on; without DP it must"
            " hold, or the claim cannot be tested at this scale)",
            +1,
            pilot,
            scope=TEXT("scope-pilot"),
        )
    ]
    out += [
        acc(
            f"by votes − uniform, both with replacement ({size}), {pool_label(s)}, ε_vote {eps:g}",
            "the votes select better samples than chance (voting raises downstream scores; Yelp,"
            " 1% strong: about +0.20 F1)",
            (s, f"votes/{eps:g}"),
            (s, "uniform"),
            TEXT("scope-votes"),
        )
        for eps in grid.epsilon_votes
        for s in (0, few)
    ]
    premise = acc(
        f"{many} strong − {few} strong without voting (uniform {size}, without replacement)",
        "more strong clients help without voting (the premise of claim 1; Yelp: 10% strong"
        " 0.6280 without voting)",
        (many, "subset"),
        (few, "subset"),
        TEXT("scope-premise"),
    )
    out.append(premise)
    premise_no = len(out)  # its R number (readouts count from 1)

    def premise_holds(r: Results) -> bool:
        return verdict(premise.value(r), +1) == IN_DIRECTION

    claim = "few strong clients with voting reach many without (Yelp: 1% strong with voting"
    claim += " 0.6149, 10% without 0.6280)"
    scope = TEXT("scope-claim", premise=premise_no)
    for eps in grid.epsilon_votes:
        name = f"{few} strong with voting (ε_vote {eps:g}) − {many} strong without"
        vs = ((few, f"votes/{eps:g}"), (many, "subset"))
        out.append(acc(name, claim, *vs, scope, testable=premise_holds))
    return out


def _eps(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    return "∞" if not math.isfinite(float(x)) else f"{float(x):.2f}"


def body(ctx: Context[Grid], res: Results) -> str:
    """Setup, the instrument, the votes' signal, scores, differences, privacy, time, scope."""
    grid = ctx.grid
    cfg = main_config(grid, grid.few)
    run, algo, task = resolved(cfg)
    a, t = algo.model_dump(), task.model_dump()
    values: dict[str, Any] = {k: f"{v:g}" for k, v in vars(grid).items() if isinstance(v, float)}
    values.update(dataset=t["dataset"], lm=t["lm"], autocast=t["autocast_bf16"])
    values.update(lora_r=t["lora"]["r"], targets=", ".join(t["lora"]["target_modules"]))
    values["lora"] = "FFA-LoRA (A frozen, B trained)" if t["lora"]["freeze_a"] else "LoRA"
    values.update({k: f"{a['generation'][k]:g}" for k in ("temperature", "top_p")})
    values.update({k: f"{a[k]:g}" for k in ("max_grad_norm", "epsilon_profile")})
    tr = run.train
    momentum = f" (momentum {tr.momentum:g})" if tr.optimizer == "sgd" and tr.momentum else ""
    values.update(embedder=a["embedder"], optimizer=f"{tr.optimizer}{momentum}")
    values.update(steps=tr.steps, batch_size=tr.batch_size, lr=f"{tr.lr:g}")
    values.update(signal_check=_signal_check(res))
    values.update(delta=f"{cfg['privacy']['delta']:g}", few=grid.few)
    # The voting readouts' SEs (R1 to Rn): the smallest difference they resolve.
    ses = [r.value(res).se for r in readouts(grid)[1 : 1 + 2 * len(grid.epsilon_votes)]]
    ses = [x for x in ses if math.isfinite(x)]
    resolution = {"difference": f"{2 * max(ses):.3f}", "n": len(ses)} if ses else {}
    return TEXT(
        "body",
        vars(grid),
        values,
        pilot=_pilot(res),
        main_missing=None if res.runs else TEXT("no-main", command=ctx.command),
        runs_done=len(res.runs),
        votes_done=len(res.votes),
        generators=len(grid.generators),
        codes=str(grid.task["dataset"]) if grid.task.get("dataset") else "rotten, fresh",
        test=(
            "every real test row" if grid.test_rows is None else f"{grid.test_rows} real test rows"
        ),
        strong=", ".join(map(str, grid.strong)),
        epsilon_votes=", ".join(f"{e:g}" for e in grid.epsilon_votes),
        instrument=_instrument(res),
        sizing=_sizing(grid, float(cfg["privacy"]["delta"])),
        signal=_signal_lines(res),
        scores=_scores_lines(res),
        within=_within_lines(res),
        between=_between_lines(res),
        privacy=_privacy_lines(res),
        shares=", ".join(f"{s} of {grid.clients}" for s in grid.strong),
        voters=len(voters(grid, grid.few)),
        resolution=f" {TEXT('resolution', resolution)}" if ses else "",
    )


def first_norm(view: RunView) -> float | None:
    """The update norm after a run's first training round (None before it)."""
    got = view.rounds.get(1, {}).get("update_norm")
    return None if got is None else float(got)


def _signal_check(res: Results) -> str:
    """The main grid's 1-strong ÷ many-strong first-round update norm, in words."""
    few, many = res.grid.few, res.grid.many
    views = [res.runs.get(s) for s in (few, many)]
    norms = [first_norm(v) if v is not None else None for v in views]
    if not all(norms):
        return TEXT("no-signal-check", few=few, many=many)
    ratio = float(norms[0]) / float(norms[1])  # type: ignore[arg-type]
    noise = math.sqrt(many / few)
    values = {"ratio": num(ratio), "noise": num(noise, 2), "few": few, "many": many}
    shared = ratio < (1 + noise) / 2  # ours: nearer a shared signal (1) than noise alone
    return TEXT("signal-check", values, reading=TEXT("shared" if shared else "noise-only"))


def _pilot(res: Results) -> str:
    """The premise pilot: each pool's scores without voting, the difference, the norms."""
    p, grid = res.pilot, res.grid
    if p is None:
        return TEXT("no-pilot")
    rows = []
    for s in (grid.few, grid.many):
        v = p["pools"][str(s)]
        cells = [Estimate(**v[k]).fmt() for k in ("accuracy", "balanced", "macro_f1")]
        norms = ", ".join(num(x, 3) for x in v["update_norms"]) or DASH
        rows.append(row([f"{s} strong, ε_train = ∞", *cells, norms]))
    est = Estimate(**p["difference"])
    first = [p["pools"][str(s)]["update_norms"][:1] for s in (grid.few, grid.many)]
    ratio = first[0][0] / first[1][0] if all(f and f[0] for f in first) else None
    values: dict[str, Any] = {"difference": est.fmt(signed=True), "mde": num(p["mde"])}
    values["ratio"] = num(ratio)
    values.update(verdict=verdict(est, +1), few=grid.few, many=grid.many)
    values["labels"] = ", ".join(map(str, p["test_labels"]))
    gate = TEXT("pilot-holds" if p["holds"] else "pilot-fails", vars(grid), values)
    return TEXT("pilot", vars(grid), values, rows=rows, gate=gate)


def _instrument(res: Results) -> str:
    """The test rows and the ceiling, each pool, the prompt probe, DP-SGD's moves, samples."""
    e = res.embed
    if e is None:
        return TEXT("no-embed")
    names = e["class_names"]
    values = {k: e[k] for k in ("test_rows", "train_rows")}
    values.update(majority=num(e["majority"]), frechet=num(e["frechet_real"]))
    values.update(acc=num(e["ceiling"]["acc"]), f1=num(e["ceiling"]["macro_f1"]))
    pools, samples = [], []
    for s, v in sorted(res.votes.items()):
        p = v["pool"]
        per_code = ", ".join(f"{c} {n}" for c, n in p["per_code"].items())
        acc = acc_level(res, (s, "pool"))
        cells = [p["samples"], p["distinct_texts"], per_code, num(p["truncated"]), p["empty"]]
        cells += [num(p["words"], 1), num(p["on_code"]), acc.fmt()]
        pools.append(row([pool_label(s), *cells]))
        for code, texts in p["examples"].items():
            short = [t.replace("\n", " ").replace("|", "/")[:200] for t in texts]
            samples += [f"- {pool_label(s)}, *{code}*: {t}" for t in short]
    return TEXT(
        "instrument",
        values,
        labels=", ".join(f"{n} {c}" for n, c in zip(names, e["test_labels"], strict=True)),
        classes=len(names),
        pools=pools,
        probe=_probe(res),
        training=_training_lines(res),
        samples=samples,
    )


def _probe(res: Results) -> str | None:
    if res.probe is None:
        return None
    lines = []
    for template, v in res.probe["templates"].items():
        est = Estimate(**v["on_code"])
        shown = " / ".join(str(t[0]).replace("|", "/")[:90] for t in v["examples"].values() if t)
        cut = "" if v.get("prompt_whole", True) else " (prompt cut)"
        cells = [est.fmt(), num(v["truncated"]), num(v["words"], 1), shown]
        lines.append(row([f"`{template}`{cut}", *cells]))
    values = {"per_code": res.probe["per_code"], "template": res.grid.prompt_template}
    return TEXT("probe", values, table=lines)


def _training_lines(res: Results) -> list[str]:
    lines = []
    for s, view in sorted(res.runs.items()):
        rounds = view.rounds
        r_train = int(view.config.get("algo", {}).get("train_rounds", 0))
        norms = [rounds.get(i, {}).get("update_norm") for i in range(1, r_train + 1)]
        entries = view.privacy.get("entries", [])
        sigmas = [m["sigma"] / m["sensitivity"] for m in entries if m["kind"] == "dp-sgd"]
        mech = view.privacy.get("mechanisms", {}).get("dp-sgd:train", {}).get("epsilon_max")
        train_s = sum(float(rounds.get(i, {}).get("time_s", 0.0)) for i in range(1, r_train + 1))
        gen_s = rounds.get(r_train + 1, {}).get("time/generate_s")
        cells = [num(max(sigmas), 3) if sigmas else DASH, _eps(mech)]
        cells += [", ".join(num(n, 2) for n in norms) or DASH, num(train_s, 0), num(gen_s, 0)]
        lines.append(row([pool_label(s), *cells]))
    return lines


def _sizing(grid: Grid, delta: float) -> str:
    """What the grid's sizes promise before any run: the expected mass against the noise."""
    from fedfm.core.privacy import analytic_gaussian_sigma

    n = len(voters(grid, grid.few))
    mass = n * grid.rows * math.sqrt(grid.k) / grid.pool
    noise = [analytic_gaussian_sigma(e, delta) * math.sqrt(n) for e in grid.epsilon_votes]
    shown = ", ".join(
        f"{x:.1f} at ε_vote {e:g}" for x, e in zip(noise, grid.epsilon_votes, strict=True)
    )
    # The earlier grid: K = 4, 9 voters of 100 rows, 200 samples, ε_vote 1.
    before = 9 * 100 * math.sqrt(4) / 200, analytic_gaussian_sigma(1.0, delta) * math.sqrt(9)
    values = {"voters": n, "mass": f"{mass:.1f}", "noise": shown}
    values.update(earlier_mass=f"{before[0]:.1f}", earlier_noise=f"{before[1]:.1f}")
    return TEXT("sizing", vars(grid), values)


def _signal_lines(res: Results) -> list[str]:
    eps = res.grid.epsilon_votes
    lines = head(
        "pool | voters | private samples | K | clean votes per entry: mean | SD | max"
        " | entries without a vote | "
        + " | ".join(f"noise SD, ε_vote {e:g}" for e in eps)
        + " | corr(votes, on-code)"
    )
    for s, v in sorted(res.votes.items()):
        g = v["signal"]
        cells = [g["voters"], g["private_samples"], g["k"]]
        cells += [num(g[k], 1) for k in ("mass_mean", "mass_sd", "mass_max")]
        cells += [num(g["zero_share"]), *[num(g["noise_sd"].get(f"{e:g}"), 1) for e in eps]]
        lines.append(row([pool_label(s), *cells, num(v.get("correlation_votes_on_code"))]))
    return lines


def _scores_lines(res: Results) -> list[str]:
    names = (res.embed or {}).get("class_names", [])
    lines = head(
        "pool | selection | accuracy | macro-F1 | Fréchet (distinct) | distinct | on-code"
        " | test rows predicted as " + " / ".join(names)
    )
    # Every selection of a pool, in the report's order.
    voted = [f"{kind}/{e:g}" for e in res.grid.epsilon_votes for kind in VOTED]
    for s in sorted(res.votes):
        for key in (k for k in ["pool", "subset", "uniform", *voted] if k in res.preds.get(s, {})):
            side = (s, key)
            cells = [acc_level(res, side).fmt(), f1_level(res, side).fmt()]
            cells.append(mean_se(seed_values(res, side, "frechet")).fmt())
            cells.append(num(float(np.mean(seed_values(res, side, "distinct"))), 1))
            cells.append(num(float(np.mean(seed_values(res, side, "on_code")))))
            cells.append(" / ".join(num(x, 2) for x in predicted(res, side, len(names))))
            kind, _, eps = key.partition("/")
            what = dict(SELECTIONS).get(kind, "the whole pool")
            lines.append(row([pool_label(s), f"{what}, ε_vote {eps}" if eps else what, *cells]))
    return lines


def _diff_cells(res: Results, a: Side, b: Side) -> list[str]:
    ests = [acc_diff(res, a, b), f1_diff(res, a, b)]
    return [marked(e) for e in [*ests, *(seed_diff(res, a, b, w) for w in ("frechet", "on_code"))]]


def _within_lines(res: Results) -> list[str]:
    pairs = [("uniform − subset (duplication alone)", "uniform", "subset")]
    for e in res.grid.epsilon_votes:
        pairs += [
            (f"by votes − uniform, ε_vote {e:g}", f"votes/{e:g}", "uniform"),
            (f"top − subset, ε_vote {e:g}", f"top/{e:g}", "subset"),
            (f"by votes − subset, ε_vote {e:g}", f"votes/{e:g}", "subset"),
        ]
    return [
        row([pool_label(s), label, *_diff_cells(res, (s, a), (s, b))])
        for s in sorted(res.votes)
        for label, a, b in pairs
    ]


def _between_lines(res: Results) -> list[str]:
    few, many = res.grid.few, res.grid.many
    pairs = [(f"{s} strong − base model", (s, "subset"), (0, "subset")) for s in res.grid.strong]
    pairs.append((f"{many} strong − {few} strong", (many, "subset"), (few, "subset")))
    for e in res.grid.epsilon_votes:
        label = f"{few} strong by votes (ε_vote {e:g}) − {many} strong"
        pairs.append((label, (few, f"votes/{e:g}"), (many, "subset")))
    return [row([f"{label}, no voting", *_diff_cells(res, a, b)]) for label, a, b in pairs]


def _privacy_lines(res: Results) -> list[str]:
    lines = []
    mech = ("dp-sgd:train", "analytic-gaussian:profile", "analytic-gaussian:vote")
    for s, v in sorted(res.votes.items()):
        for e, p in v["privacy"].items():
            eps = [*(p["mechanisms"].get(k) for k in mech), p["strong"], p["weak"]]
            lines.append(row([pool_label(s), e, num(p["sigma_vote"], 3), *map(_eps, eps)]))
    return lines


STUDY = register(
    __name__,
    "DP federated text generation: the weak clients' votes against chance",
    ("dpsyn-study.md", "dpsyn-quick.md"),
    workers=(2, 2),  # the 4-strong generator alone is most of one worker's time
)
