"""FedSDR reproduction study (ICML 2026, arXiv 2605.18028; METHODS.md section 1).

Does FedSD keep more general ability, and is it more than moving less?

Its premise first (DESIGN principle 18): FedIT (the pilot, ``fedfm reproduce fedsdr --pilot``)
at a budget and a client mix far from chat prose must *cause* forgetting on what no client
trains on (held-out instruction NLL, C4 NLL, class-balanced zero-shot labels); only then do
+FedSD, FedSDR and the matched-drift control run (their configs wait for the pilot to hold).
Zero-shot label tasks are read by balanced accuracy (a majority answer scores 1 / C).

FedIT, +FedSD (trained on the global model's rewrites of the clients' answers), FedSDR (adds
a LoRA-R on the raw answers, aggregated alone) and a matched-drift FedIT (lr rescaled once to
+FedSD's update norm), scored by likelihood only: zero-shot label accuracy on domains no
client trains on and the NLL and top-1 token accuracy of held-out C4 text (kept ability), the
references' NLL of the trained domains (fidelity), each difference paired over items.

FedSDR is scored as its global model (base + R, the run's own evaluation) and as each client's
personalised model (base + R + S_k, :func:`score_personal`, from the run's final checkpoint).
Choices of ours: maths rewrites must keep their chain of thought (``Grid.keep_reasoning``,
:func:`fedfm.algorithms.rewrite.reasoning_words`) beside their final number, else the row trains
on its reference; a personal model's value on a held-out unit is the mean over the clients.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.analyze import REWRITE_KEYS, distribution_analysis, update_cosine_rows
from fedfm.core.runfolder import read_jsonl, write_jsonl
from fedfm.reproduce.framework import (
    Compute,
    Context,
    Job,
    Readout,
    Run,
    RunView,
    Unmet,
    preset,
    register,
    resolved,
    task_of,
    untestable,
)
from fedfm.reproduce.stats import (
    IN_DIRECTION,
    NONE,
    Estimate,
    balanced_accuracy,
    balanced_weights,
    macro_f1,
    mean_of,
    paired,
    verdict,
)
from fedfm.reproduce.tables import DASH, Text, joined, marked, num, table

TEXT = Text("fedsdr")
METHODS = ("fedit", "fedsd", "fedsdr", "matched")
PERSONAL = "personal"  # FedSDR's personalised models base + R + S_k (a computation)
LABELS = {
    "base": "base (round 0)",
    "fedit": "FedIT",
    "fedsd": "+FedSD",
    "fedsdr": "FedSDR R (global)",
    PERSONAL: "FedSDR R + S (personal)",
    "matched": "matched-drift FedIT",
}
BASE = "base"  # FedIT's round-0 evaluation: the untrained model
MODELS = ("base", "fedit", "fedsd", "fedsdr", PERSONAL, "matched")  # the rows of the tables
# The study's commands: the pilot, then three parts (each under the 90-minute rule on 2 cores;
# in one command the main grid's critical path, +FedSD, FedSDR, the personal scoring, is not).
PARTS = ("pilot", "fedsd", "fedsdr", PERSONAL)
PART_OF = {"fedit": "pilot", "fedsd": "fedsd", "fedsdr": "fedsdr", "matched": "fedsdr"}
PART_OF[PERSONAL] = PERSONAL
PERSONAL_ITEMS = "items.jsonl"  # the personal models' items, one line per client
CORPUS = "c4_demo"
PAPER_JS = (0.4074, 0.3611)
PAPER_TFIDF = (0.6362, 0.7064)


@dataclass(frozen=True)
class Grid:
    """A study grid.

    Attributes:
        rounds: Rounds of every run (the pilot's budget is the grid's: FedIT is the pilot).
        steps, steps_s: Local steps per round (FedSDR: of LoRA-R), LoRA-S steps before them.
        lr: Local learning rate (AdamW) of every method but the matched-drift control.
        per_domain: Training items per client (one client per trained domain, ``domains``).
        seen_items, zeroshot_items: Items evaluated per trained and per ``zeroshot`` domain.
        docs: C4 documents scored, their first ``doc_tokens`` tokens each.
        heldout: Held-out instruction domains scored by their references' NLL (no client
            trains on them; e.g. general chat prose, far from the clients' tasks).
        optimizer: The server optimizer; ``rewrite_tokens``: new tokens of a FedSD rewrite.
        keep_reasoning: The acceptance rule of ours for maths rewrites (+FedSD and FedSDR,
            ``algo.fedsd.keep_reasoning``): a GSM8K rewrite is kept only with its final number
            and at least this share of the reference's reasoning words; ``None``: off.
        balanced_test: Labelled test sets with every label equally often (the source allows).
        gated: Whether +FedSD, FedSDR and the control wait for the pilot to show forgetting
            (False: they run whatever it shows, e.g. to time the grid at a tiny size).
        task: Fields replacing the task's (e.g. a tiny model in tests).
        label: Which grid it is, for the report's title.
        cache_dir: Folder of the rewrite cache; ``None``: the default.
    """

    rounds: int = 3
    steps: int = 32
    steps_s: int = 32
    lr: float = 2e-3
    per_domain: int = 96
    seen_items: int = 40
    zeroshot_items: int = 200
    docs: int = 200
    doc_tokens: int = 128
    domains: tuple[str, ...] = ("math", "medical", "qtype")
    zeroshot: tuple[str, ...] = ("movie", "spam")
    heldout: tuple[str, ...] = ("general",)
    optimizer: str = "fedavg"
    rewrite_tokens: int = 384
    keep_reasoning: float | None = 0.5
    balanced_test: bool = True
    gated: bool = True
    task: Mapping[str, Any] = field(default_factory=dict)
    label: str = "full grid"
    cache_dir: str | None = None


# The earlier grid (3 rounds x 16 steps at lr 1e-3, clients general, math and medical)
# lowered C4's NLL (FedIT - base -0.015 +- 0.004): nothing to forget. Its clients now hold
# GSM8K solutions and two label tasks, none of them chat prose, with general instructions held
# out, at 3 x 32 = 96 steps each and lr 2e-3 (2x the steps, 4x the lr x steps). Sized to the
# 90-minute pilot: the earlier FedIT took 2,797 CPU s for 48 steps per client and two
# evaluations, so 96 steps are about 80 CPU minutes (an estimate; the pilot measures it).
# Rewrites get 384 new tokens (192 cut 31% of them).
FULL = Grid()
QUICK = Grid(
    rounds=2, steps=16, steps_s=16, seen_items=24, zeroshot_items=100, docs=100, label="quick grid"
)


def job_config(grid: Grid, method: str, lr: float | None = None) -> dict[str, Any]:
    """The run config of one method (``lr`` replaces the grid's, for the matched control)."""
    cfg = preset("fedsdr")
    cfg.update(rounds=grid.rounds, plots=False, eval_every=grid.rounds)
    cfg["eval_before"] = method == "fedit"  # its round 0 is the untrained base
    task = cfg["task"]
    heldout = [*grid.zeroshot, *grid.heldout]
    # Seen items of the trained domains, more of the others: a balanced draw of the zero-shot
    # count would exhaust a trained label task's rarest label (medical holds 36 of one).
    n_test = {d: grid.seen_items for d in grid.domains}
    n_test |= dict.fromkeys(heldout, grid.zeroshot_items)
    source: dict[str, Any] = {"per_domain_train": grid.per_domain, "per_domain_test": n_test}
    if grid.balanced_test:
        source["balanced_test"] = True
    task["source_options"].update(source, domains=[*grid.domains, *heldout])
    task.update(train_domains=list(grid.domains), heldout_domains=heldout)
    task.update(zeroshot_items=grid.zeroshot_items, max_eval=grid.seen_items * len(grid.domains))
    task.update(choice_mode="loglik", choice_norm="none", eval_ppl=True, likelihood_only=True)
    task["text_nll"] = {"corpus": CORPUS, "docs": grid.docs, "max_tokens": grid.doc_tokens}
    task.update(primary="zeroshot/score", eval_batch_size=8)
    task.update(copy.deepcopy(dict(grid.task)))
    cfg["clients"] = {"fraction": 1.0, "min_clients": len(grid.domains)}
    cfg["train"].update(steps=grid.steps, lr=grid.lr if lr is None else lr)
    refine = cfg["algo"]["fedsd"]
    refine["decoding"]["max_new_tokens"] = grid.rewrite_tokens
    if grid.cache_dir is not None:
        refine["cache_dir"] = grid.cache_dir
    if method in ("fedsd", "fedsdr") and grid.keep_reasoning is not None:
        refine["keep_reasoning"] = grid.keep_reasoning  # FedIT's config stays without it
    server = {"name": grid.optimizer}
    if method == "fedsdr":
        steps = {"steps_s": grid.steps_s, "steps_r": grid.steps}
        cfg["algo"].update(server_opt=server, **steps, update_cosines=True)
        return cfg
    cfg["algorithm"] = "fedavg"
    fedsd = {"enabled": method == "fedsd", **refine}
    cfg["algo"] = {"server_opt": server, "update_cosines": True, "fedsd": fedsd}
    return cfg


def matched_lr(grid: Grid, fedit: RunView, fedsd: RunView) -> tuple[float, float]:
    """The matched-drift control's lr and the norm ratio it comes from.

    The ratio is ‖Δ_FedSD‖ / ‖Δ_FedIT‖; :class:`Unmet` where a run logged no, or a zero, update
    norm.
    """
    a, b = fedit.final.get("update_norm"), fedsd.final.get("update_norm")
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a <= 0 or b <= 0:
        raise Unmet(f"FedIT's or +FedSD's update norm is missing ({a}, {b})")
    return grid.lr * b / a, b / a


PILOT_MEASURES = ("text", "heldout", "bacc", "top1")  # forgetting on what no client trains on
FORGETTING = {"text": +1, "heldout": +1, "bacc": -1, "top1": -1}  # the direction of forgetting


def forgetting(grid: Grid, fedit: RunView) -> dict[str, Estimate]:
    """The pilot's readouts from FedIT's own folder.

    FedIT (last round) − base (round 0) on each of :data:`PILOT_MEASURES`.
    """
    res = Results({"fedit": fedit}, None)
    return {m: diff(res, "fedit", BASE, m, grid) for m in PILOT_MEASURES}


def pilot_holds(grid: Grid, fedit: RunView) -> bool:
    """Whether a readout shows forgetting.

    Forgetting shown: an NLL on held-out text rises, or the balanced accuracy or C4's top-1
    token accuracy falls, by more than 2 SE (a measure the run did not record, e.g. top-1
    before the evaluator had it, shows nothing).
    """
    got = forgetting(grid, fedit)
    return any(verdict(got[m], FORGETTING[m]) == IN_DIRECTION for m in PILOT_MEASURES)


def _after_pilot(grid: Grid, method: str, needs: Mapping[str, RunView]) -> dict[str, Any]:
    """A main run's config, once the pilot has shown forgetting (else :class:`Unmet`)."""
    if grid.gated and not pilot_holds(grid, needs["fedit"]):
        shown = ", ".join(
            f"{m} {e.fmt(signed=True)}" for m, e in forgetting(grid, needs["fedit"]).items()
        )
        raise Unmet(f"the pilot shows no forgetting ({shown}): FedSD has nothing to prevent")
    if method == "matched":
        lr, _ = matched_lr(grid, needs["fedit"], needs["fedsd"])
        return job_config(grid, "matched", lr=lr)
    return job_config(grid, method)


def jobs(ctx: Context[Grid]) -> list[Job]:
    """The pilot (FedIT, its round 0 the base) and the references' lengths.

    Then, where the pilot shows forgetting, +FedSD, FedSDR after it and the matched-drift control.
    """
    grid = ctx.grid
    pilot: list[Job] = [
        Run("fedit", job_config(grid, "fedit"), group="train", part=PART_OF["fedit"]),
        Compute("lengths", measure_lengths, {"config": job_config(grid, "fedit")}, part="pilot"),
    ]
    if ctx.pilot:
        return pilot

    def after(method: str) -> Callable[[Mapping[str, RunView]], dict[str, Any]]:
        return lambda needs: _after_pilot(grid, method, needs)

    personal = {"config": job_config(grid, "fedsdr"), "rounds": grid.rounds}
    return [
        *pilot,
        Run("fedsd", after("fedsd"), needs=("fedit",), group="train", part=PART_OF["fedsd"]),
        Run("fedsdr", after("fedsdr"), ("fedit", "fedsd"), "fedsdr", PART_OF["fedsdr"]),
        Compute(PERSONAL, score_personal, personal, ("fedsdr",), PERSONAL, PART_OF[PERSONAL]),
        Run("matched", after("matched"), ("fedit", "fedsd"), "train", PART_OF["matched"]),
    ]


def score_personal(
    inputs: Mapping[str, Path], folder: Path, config: Mapping[str, Any], rounds: int
) -> dict[str, Any]:
    """FedSDR's personalised models, base + R + S_k, scored from the run's final checkpoint.

    The run scores its global model (base + R) alone; each client's LoRA-S never leaves it and
    is in the client's state of the checkpoint after the last round (with R, the server's
    ``params``). Each client's model is scored on its own domains' seen test items and on every
    held-out readout (zero-shot labels, held-out instructions, C4 text): the same items, by the
    same evaluator, as the global model's last evaluation. Nothing is trained again.

    Returns:
        Per client, its domains and its metrics; the items go to ``items.jsonl`` in ``folder``.
    """
    from fedfm.algorithms.fedsdr import S_GROUP, R, S
    from fedfm.core.checkpoint import latest_checkpoint, load_checkpoint
    from fedfm.core.groups import get_group
    from fedfm.errors import FedfmError
    from fedfm.tasks.base import HasFoundationModel, capable
    from fedfm.tasks.lm import InstructionData, InstructionTask

    path = latest_checkpoint(inputs["fedsdr"] / "checkpoints")
    ck = None if path is None else load_checkpoint(path)
    if ck is None or ck.rnd != rounds:
        raise FedfmError(f"FedSDR's checkpoint of round {rounds} is missing ({path})")
    task = task_of(config)
    if not isinstance(task, InstructionTask):
        raise TypeError(f"the study's task is an instruction task, not {type(task).__name__}")
    fm = capable(task, HasFoundationModel).foundation_model()
    lora_r, test = get_group(ck.server_arrays, "params"), task.test_data()
    out: dict[str, Any] = {"round": ck.rnd, "clients": {}}
    lines = []
    for cid in task.client_ids():
        p = f"{cid}::"
        mine = {k.removeprefix(p): v for k, v in ck.client_arrays.items() if k.startswith(p)}
        lora_s = get_group(mine, S_GROUP)
        if not lora_s:
            raise FedfmError(f"client {cid} has no LoRA-S in FedSDR's checkpoint ({path})")
        domains = sorted(set(task.client_data(cid).rows["domain"]))
        keep = [i for i, d in enumerate(test.rows["domain"]) if d in domains]
        data = InstructionData(test.rows.select(keep), test.heldout, test.documents)
        with fm.slot(R, lora_r), fm.slot(S, lora_s), fm.use([R, S]) as model:
            metrics, items = task.evaluate_items(model, data)
        out["clients"][cid] = {"domains": domains, "metrics": metrics}
        lines.append({"client": cid, "items": items})
    folder.mkdir(parents=True, exist_ok=True)
    # JSON round trip, as the engine keeps items: fields may be numpy scalars.
    write_jsonl(folder / PERSONAL_ITEMS, json.loads(json.dumps(lines, default=str)))
    return dict(json.loads(json.dumps(out, default=str)))


def _quantiles(values: Sequence[int]) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    return {"n": len(v), "p50": np.median(v), "p90": np.percentile(v, 90), "max": v.max()}


def measure_lengths(inputs: Mapping[str, Path], folder: Path, config: Mapping[str, Any]) -> dict:
    """Token lengths of the references per domain and part, and the share cut by the budget."""
    from fedfm.data.prompt import fit_prompt
    from fedfm.tasks.lm import InstructionTask

    task = task_of(config)
    if not isinstance(task, InstructionTask):
        raise TypeError(f"the study's task is an instruction task, not {type(task).__name__}")
    tok, prompt = task.tokenizer, task.cfg.prompt
    parts = {
        "train": [task.client_data(c).rows for c in task.client_ids()],
        "evaluated": [task.test_data().rows],
        "zero-shot": [task.test_data().heldout],
    }
    out: dict[str, Any] = {"max_length": prompt.max_length}
    for part, sets in parts.items():
        refs: dict[str, list[int]] = {}
        cut: dict[str, list[bool]] = {}
        for rows in (s for s in sets if s is not None):
            for r in rows:
                n_prompt = len(fit_prompt(tok, r["instruction"], r["input"] or "", prompt)[1])
                n = len(tok(r["output"], add_special_tokens=False)["input_ids"]) + 1
                refs.setdefault(r["domain"], []).append(n)
                cut.setdefault(r["domain"], []).append(n_prompt + n > prompt.max_length)
        out[part] = {
            d: {**_quantiles(v), "cut": float(np.mean(cut[d]))} for d, v in sorted(refs.items())
        }
    return out


@dataclass
class Results:
    """The finished runs by method, the reference-length measurement, the personal models.

    ``personal``: each FedSDR client's items of base + R + S_k (:func:`score_personal`), by
    client; ``personal_rows`` their metrics.
    """

    runs: dict[str, RunView]
    lengths: dict[str, Any] | None
    personal: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    personal_rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def items(self, method: str) -> list[dict[str, Any]]:
        """A method's evaluated items (the base: FedIT's round 0; personal: every client's)."""
        if method == BASE:
            return self.runs["fedit"].items(0) if "fedit" in self.runs else []
        if method == PERSONAL:
            return [it for its in self.personal.values() for it in its]
        return self.runs[method].items() if method in self.runs else []

    def has(self, method: str) -> bool:
        """Whether the method's items are there."""
        return bool(self.items(method))

    def row(self, method: str) -> dict[str, Any]:
        """The metrics row of a method's evaluation (the base: FedIT's round 0).

        The personal models': each metric's mean over the clients that report it.
        """
        if method == BASE:
            return self.runs["fedit"].rounds.get(0, {}) if "fedit" in self.runs else {}
        if method == PERSONAL:
            keys = {k for r in self.personal_rows.values() for k in r}
            got = {k: [r[k] for r in self.personal_rows.values() if k in r] for k in keys}
            return {k: float(np.mean(v)) for k, v in got.items() if _numbers(v)}
        return self.runs[method].final if method in self.runs else {}

    def shown(self) -> list[str]:
        """The base and the models whose items are there."""
        return [m for m in MODELS if self.has(m)]

    def ran(self) -> list[tuple[str, RunView]]:
        """The finished runs, in the order of :data:`METHODS`."""
        return [(m, self.runs[m]) for m in METHODS if m in self.runs]


def _numbers(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def read(ctx: Context[Grid]) -> Results:
    """The finished runs, the length measurement and the personal models' items."""
    runs = {m: ctx.run(m) for m in METHODS if ctx.run(m).finished}
    res = Results(runs, ctx.run("lengths").result)
    done = ctx.run(PERSONAL)
    if done.result is not None and (done.folder / PERSONAL_ITEMS).exists():
        for line in read_jsonl(done.folder / PERSONAL_ITEMS, need_round=False):
            res.personal[str(line["client"])] = list(line["items"])
        res.personal_rows = {c: dict(v["metrics"]) for c, v in done.result["clients"].items()}
    return res


def _per_token(it: Mapping[str, Any]) -> float:
    n = int(it.get("nll_tokens") or 0)
    return float(it["nll"]) / n if n else math.nan


def per_domain(
    items: Sequence[Mapping[str, Any]], domains: Sequence[str], zeroshot: bool
) -> dict[str, dict[Any, float]]:
    """``{domain: {item id: value}}``: zero-shot label accuracy, or reference NLL per token."""
    out: dict[str, dict[Any, float]] = {d: {} for d in domains}
    for it in items:
        if bool(it.get("zeroshot")) == zeroshot and it["domain"] in out:
            value = it.get("score") if zeroshot else _per_token(it) if "nll" in it else None
            if value is not None:
                out[it["domain"]][it["id"]] = float(value)
    return out


def heldout_nll(
    items: Sequence[Mapping[str, Any]], domains: Sequence[str]
) -> dict[str, dict[Any, float]]:
    """``{domain: {item id: reference NLL per token}}`` of the held-out instruction domains."""
    out: dict[str, dict[Any, float]] = {d: {} for d in domains}
    for it in items:
        if it.get("zeroshot") and it["domain"] in out and "nll" in it:
            out[it["domain"]][it["id"]] = _per_token(it)
    return out


def labelled(items: Sequence[Mapping[str, Any]], domain: str) -> list[Mapping[str, Any]]:
    """The scored zero-shot label items of one domain."""
    return [
        it
        for it in items
        if it.get("zeroshot") and it["domain"] == domain and it.get("score") is not None
    ]


def balanced(
    items: Sequence[Mapping[str, Any]], domains: Sequence[str]
) -> dict[str, dict[Any, float]]:
    """``{domain: {item id: correctness × N / (C · n_c)}}``.

    Each domain's mean is its balanced accuracy (:func:`~fedfm.reproduce.stats.balanced_weights`,
    over the gold labels).
    """
    out: dict[str, dict[Any, float]] = {}
    for d in domains:
        its = labelled(items, d)
        w = balanced_weights([it["reference"] for it in its])
        out[d] = {it["id"]: float(it["score"]) * float(x) for it, x in zip(its, w, strict=True)}
    return out


def class_scores(items: Sequence[Mapping[str, Any]], domain: str) -> dict[str, float]:
    """Accuracy, balanced accuracy and macro-F1 of one zero-shot domain, from its items."""
    its = labelled(items, domain)
    y = [str(it["reference"]) for it in its]
    pred = [str(it.get("label", it["answer"])) for it in its]
    if not its:
        return {}
    acc = float(np.mean([float(it["score"]) for it in its]))
    return {"acc": acc, "bacc": balanced_accuracy(y, pred), "f1": macro_f1(y, pred)}


def text_nll(items: Sequence[Mapping[str, Any]]) -> dict[Any, float]:
    """``{document id: NLL per token}`` of the held-out general text."""
    return {it["id"]: _per_token(it) for it in items if it.get("metric") == "text_nll"}


def text_top1(items: Sequence[Mapping[str, Any]]) -> dict[Any, float]:
    """``{document id: top-1 token accuracy}`` of the held-out general text (where scored)."""
    return {
        it["id"]: int(it["top1"]) / int(it["nll_tokens"])
        for it in items
        if it.get("metric") == "text_nll" and "top1" in it and int(it.get("nll_tokens") or 0)
    }


# A measure of a model's items: {domain or corpus: {unit: value}}.
Measure = Callable[[Sequence[Mapping[str, Any]], Grid], "dict[str, dict[Any, float]]"]

MEASURES: dict[str, tuple[str, Measure]] = {
    "bacc": (
        "zero-shot balanced accuracy (movie, spam)",
        lambda items, grid: balanced(items, grid.zeroshot),
    ),
    "acc": (
        "zero-shot label accuracy (movie, spam)",
        lambda items, grid: per_domain(items, grid.zeroshot, True),
    ),
    "text": ("NLL per token, held-out C4 text", lambda items, _: {CORPUS: text_nll(items)}),
    "top1": ("top-1 token accuracy, held-out C4 text", lambda its, _: {CORPUS: text_top1(its)}),
    "heldout": (
        "reference NLL per token, held-out instructions",
        lambda items, grid: heldout_nll(items, grid.heldout),
    ),
    "fidelity": (
        "reference NLL per token, trained domains",
        lambda items, grid: per_domain(items, grid.domains, False),
    ),
}


def values(res: Results, m: str, measure: str, grid: Grid) -> dict[str, dict[Any, float]]:
    """A model's values on a measure, ``{domain or corpus: {unit: value}}``.

    The personal models' value of a unit is its mean over the clients that scored it (every
    client a held-out unit, one client a seen item of its own domain), so a difference with
    another model stays paired over the same units.
    """
    fn = MEASURES[measure][1]
    if m != PERSONAL:
        return fn(res.items(m), grid)
    per = [fn(items, grid) for items in res.personal.values()]
    out: dict[str, dict[Any, float]] = {}
    for d in {d for got in per for d in got}:
        units = {u for got in per for u in got.get(d, {})}
        out[d] = {u: float(np.mean([g[d][u] for g in per if u in g.get(d, {})])) for u in units}
    return out


def diff(res: Results, a: str, b: str, measure: str, grid: Grid) -> Estimate:
    """``a − b`` on a measure: paired over units per domain, the mean over domains."""
    if not (res.has(a) and res.has(b)):
        return NONE
    va, vb = values(res, a, measure, grid), values(res, b, measure, grid)
    parts = [paired(va[d], vb.get(d, {})) for d in sorted(va)]
    parts = [p for p in parts if p.n]
    return parts[0] if len(parts) == 1 else mean_of(parts)


def level(res: Results, m: str, measure: str, grid: Grid) -> dict[str, float]:
    """A model's mean per domain (and ``mean``, over domains) on a measure."""
    if not res.has(m):
        return {}
    got = values(res, m, measure, grid)
    per = {d: float(np.mean(list(v.values()))) for d, v in got.items() if v}
    return {**per, **({"mean": float(np.mean(list(per.values())))} if per else {})}


def readouts(grid: Grid) -> list[Readout[Results]]:
    """The pilot's three readouts, then the comparisons the study exists for.

    The pilot's three readouts (FedIT − base on what no client trains on), then the
    comparisons the study exists for (fixed before the runs), testable where the pilot holds.
    """

    def est(a: str, b: str, measure: str) -> Callable[[Results], Estimate]:
        return lambda r: diff(r, a, b, measure, grid)

    def premise(r: Results) -> bool:
        return "fedit" in r.runs and pilot_holds(grid, r.runs["fedit"])

    items, docs = "paired over items, mean over domains", "paired over documents"
    values = {**vars(grid), "domains": ", ".join(grid.domains)}
    values["zeroshot"] = " and ".join(grid.zeroshot)
    values["heldout"] = ", ".join(grid.heldout)
    kinds = ("kept", "fidelity", "matched", "premise", "benchmarks", "personal")
    sc = {k: TEXT(f"scope-{k}", values) for k in kinds}  # what each kind of readout measures
    held = ", ".join(grid.heldout)
    pilot = (  # name, statistic, the premise, direction, measure
        ("pilot: FedIT − base (round 0), NLL per token of held-out C4 text", docs,
         "the budget causes forgetting: FedIT's NLL above the base's", +1, "text"),
        (f"pilot: FedIT − base, reference NLL of held-out instructions ({held})", items,
         "the budget causes forgetting: FedIT's NLL above the base's", +1, "heldout"),
        ("pilot: FedIT − base, zero-shot balanced accuracy (movie, spam)", items,
         "the budget causes forgetting: FedIT below the base", -1, "bacc"),
        ("pilot: FedIT − base, top-1 token accuracy of held-out C4 text", docs,
         "the budget causes forgetting: FedIT below the base", -1, "top1"),
    )  # fmt: skip
    rows = (  # name, statistic, the paper, direction, a, b, measure, scope, the paper's margin
        ("+FedSD − FedIT, zero-shot balanced accuracy (movie, spam)", items,
         "+FedSD keeps more general ability (overall 71.21 → 74.54 with FedAvg)", +1, "fedsd",
         "fedit", "bacc", "kept", 0.0333),
        ("+FedSD − FedIT, NLL per token of held-out C4 text", docs,
         "+FedSD keeps more general ability (lower NLL)", -1, "fedsd", "fedit", "text", "kept",
         None),
        (f"+FedSD − FedIT, reference NLL of held-out instructions ({held})", items,
         "+FedSD keeps more general ability (lower NLL)", -1, "fedsd", "fedit", "heldout",
         "kept", None),
        ("+FedSD − FedIT, reference NLL of the trained domains (fidelity)", items,
         "the rewrite paradox: rewrites (≈47% not entailing the reference) move the model away"
         " from the clients' references (higher NLL)", +1, "fedsd", "fedit", "fidelity",
         "fidelity", None),
        ("FedSDR R (global) − +FedSD, reference NLL of the trained domains (fidelity)", items,
         "LoRA-R on the raw answers rectifies: FedSDR closer to the references (lower NLL)", -1,
         "fedsdr", "fedsd", "fidelity", "fidelity", None),
        ("+FedSD − matched-drift FedIT, zero-shot balanced accuracy", items,
         "the gain is the refinery's, not a smaller drift's (+FedSD above)", +1, "fedsd",
         "matched", "bacc", "matched", None),
        ("+FedSD − matched-drift FedIT, NLL per token of held-out C4 text", docs,
         "the gain is the refinery's (+FedSD lower)", -1, "fedsd", "matched", "text", "matched",
         None),
        ("FedSDR R (global) − FedIT, zero-shot balanced accuracy", items,
         "FedSDR keeps more general ability than FedIT", +1, "fedsdr", "fedit", "bacc",
         "personal", None),
        ("FedSDR R + S (personal) − FedIT, zero-shot balanced accuracy", items,
         "FedSDR keeps more general ability than FedIT", +1, PERSONAL, "fedit", "bacc",
         "personal", None),
        ("FedSDR R + S (personal) − FedIT, NLL per token of held-out C4 text", docs,
         "FedSDR keeps more general ability (lower NLL)", -1, PERSONAL, "fedit", "text",
         "personal", None),
        (f"FedSDR R + S (personal) − FedIT, reference NLL of held-out instructions ({held})",
         items, "FedSDR keeps more general ability (lower NLL)", -1, PERSONAL, "fedit",
         "heldout", "personal", None),
        ("FedSDR R + S (personal) − +FedSD, reference NLL of each client's own domain"
         " (fidelity)", items, "LoRA-R on the raw answers rectifies: closer to the references"
         " (lower NLL)", -1, PERSONAL, "fedsd", "fidelity", "personal", None),
    )  # fmt: skip
    return [
        *(
            Readout(name, stat, paper, sign, est("fedit", BASE, m), scope=sc["premise"])
            for name, stat, paper, sign, m in pilot
        ),
        *(
            Readout(
                name,
                stat,
                paper,
                sign,
                est(a, b, m),
                scope=sc[scope],
                testable=premise,
                margin=margin,
            )
            for name, stat, paper, sign, a, b, m, scope, margin in rows
        ),
        untestable(
            "+FedSD − FedIT on MMLU, BBH, CRASS and DROP",
            "+FedSD above FedIT on each (e.g. CRASS 47.81 → 56.57 with FedAvg)",
            sc["benchmarks"],
        ),
    ]


def _zeroshot_tables(grid: Grid, res: Results) -> str | None:
    """What the scorer predicted on each zero-shot domain, beside the baselines."""
    parts: list[Any] = []
    for d in grid.zeroshot:
        pred = f"zeroshot/pred/{d}/"
        found = {k for m in res.shown() for k in res.row(m) if k.startswith(pred)}
        labels = sorted({k.rsplit("/", 1)[1] for k in found})
        rows = []
        for m in res.shown():
            r = res.row(m)
            keys = [f"{k}/{d}" for k in ("acc", "majority", "uniform")]
            keys += [f"pred/{d}/{x}" for x in labels]
            cells = [num(r.get(f"zeroshot/{k}")) for k in keys]
            got = class_scores(res.items(m), d)
            cells[1:1] = [num(got.get("bacc")), num(got.get("f1"))]
            rows.append([LABELS[m], *cells, f"{r.get(f'zeroshot/n/{d}', 0):.0f}"])
        header = ["model", f"acc {d}", "balanced acc", "macro-F1", "majority", "uniform"]
        header += [f"answered {x}" for x in labels]
        parts += [f"**{d}**", table([*header, "items"], rows)]
    return joined(*parts) or None


def _trained_labels(grid: Grid, res: Results) -> str | None:
    """The trained classification domains' accuracy beside their majority baseline."""
    seen = [d for d in grid.domains if any(f"pred/{d}/" in k for k in res.row(BASE))]
    if not seen:
        return None

    def cell(r: Mapping[str, Any], d: str) -> str:
        return f"{num(r.get(f'acc/{d}'))} (maj. {num(r.get(f'majority/{d}'))})"

    rows = [[LABELS[m], *(cell(res.row(m), d) for d in seen)] for m in res.shown()]
    return TEXT("trained-labels", table=table(["model", *seen], rows))


def _lengths(res: Results) -> str | None:
    """The references' token lengths against the training and NLL budget."""
    if not res.lengths:
        return None
    rows = [
        [part, d, *(f"{v[k]:.0f}" for k in ("n", "p50", "p90", "max")), num(v["cut"])]
        for part in ("train", "evaluated")
        for d, v in res.lengths.get(part, {}).items()
    ]
    return TEXT("lengths", max_length=int(res.lengths["max_length"]), rows=rows)


def _doc_tokens(grid: Grid, res: Results) -> str | None:
    """How much of the held-out C4 text is scored."""
    docs = res.items(BASE) and [it for it in res.items(BASE) if it.get("metric") == "text_nll"]
    if not docs:
        return None
    toks = [int(it["nll_tokens"]) for it in docs]
    full = sum(t == grid.doc_tokens - 1 for t in toks)
    values = {"n": len(docs), "tokens": f"{sum(toks):,}", "full": full}
    return TEXT("doc-tokens", values, doc_tokens=grid.doc_tokens, mean=f"{np.mean(toks):.0f}")


def _levels_table(grid: Grid, res: Results) -> list[str]:
    rows = []
    for m in res.shown():
        acc, bacc, text, top1, held, fid = (
            level(res, m, k, grid) for k in ("acc", "bacc", "text", "top1", "heldout", "fidelity")
        )
        cells = [num(acc.get(d)) for d in [*grid.zeroshot, "mean"]] + [num(bacc.get("mean"))]
        cells += [num(text.get(CORPUS)), num(top1.get(CORPUS))]
        cells += [num(held.get(d)) for d in grid.heldout]
        rows.append([LABELS[m], *cells, *(num(fid.get(d)) for d in [*grid.domains, "mean"])])
    header = ["model", *(f"acc {d}" for d in grid.zeroshot), "acc mean", "balanced acc mean"]
    header += ["C4 NLL/token", "C4 top-1", *(f"held-out NLL {d}" for d in grid.heldout)]
    return table([*header, *(f"ref. NLL {d}" for d in grid.domains), "ref. NLL mean"], rows)


PAIRS: tuple[tuple[str, str], ...] = (("fedit", BASE), ("fedsd", BASE), ("fedsd", "fedit"))
PAIRS += (("fedsdr", "fedit"), ("fedsdr", "fedsd"), ("matched", "fedit"), ("fedsd", "matched"))
PAIRS += ((PERSONAL, "fedsdr"), (PERSONAL, "fedit"), (PERSONAL, "fedsd"))


def _diff_table(
    grid: Grid, res: Results, measure: str | None = None, keys: Sequence[str] = ()
) -> list[str]:
    """The paired differences of :data:`PAIRS`: on every measure, or on one per domain."""
    rows = []
    for a, b in ((a, b) for a, b in PAIRS if res.has(a) and res.has(b)):
        if measure is None:
            cells = [marked(diff(res, a, b, k, grid)) for k in MEASURES]
        else:
            va, vb = (values(res, m, measure, grid) for m in (a, b))
            cells = [marked(paired(va.get(d, {}), vb.get(d, {}))) for d in keys]
        rows.append([f"{LABELS[a]} − {LABELS[b]}", *cells])
    header = [MEASURES[k][0] for k in MEASURES] if measure is None else keys
    return table(["difference", *header], rows)


def _norms(grid: Grid, res: Results) -> list[str]:
    """Each method's update norm and training loss per round."""
    rounds = range(1, grid.rounds + 1)
    rows = []
    for m, r in res.ran():
        lr = float(r.config.get("train", {}).get("lr", math.nan))
        cells = [num(r.rounds.get(k, {}).get("update_norm"), 4) for k in rounds]
        cells += [num(r.rounds.get(k, {}).get("train_loss"), 3) for k in rounds]
        rows.append([LABELS[m], f"{lr:.3g}", *cells])
    header = ["method", "local lr", *(f"‖θ_{k} − θ_0‖" for k in rounds)]
    return table([*header, *(f"train loss r{k}" for k in rounds)], rows)


def _matched(grid: Grid, res: Results) -> str | None:
    """The matched-drift control's rule and the norm it reached."""
    if not {"fedit", "fedsd"} <= set(res.runs):
        return None
    try:
        lr, ratio = matched_lr(grid, res.runs["fedit"], res.runs["fedsd"])
    except Unmet as e:
        return TEXT("unmatched", error=e)
    target = float(res.runs["fedsd"].final["update_norm"])
    got = res.runs.get("matched")
    norm = float(got.final["update_norm"]) if got and "update_norm" in got.final else None
    achieved = "it has not run" if norm is None else f"its update norm is {norm:.4f}, "
    achieved += "" if norm is None else f"{norm / target:.3f}× +FedSD's"
    values = {"lr": f"{grid.lr:g}", "ratio": f"{ratio:.4f}", "matched_lr": f"{lr:.4g}"}
    return TEXT("matched", values, achieved=achieved)


def _rewrites(res: Results, grid: Grid) -> str:
    """FedSD's rewrites: kept and fallback rows per domain, and their statistics."""
    parts: list[Any] = []
    for m in ("fedsd", "fedsdr"):
        zero = res.runs[m].rounds.get(0, {}) if m in res.runs else {}
        if "fedsd/rows" not in zero:
            continue
        fall = "fedsd/fallback_"
        reasons = [k.removeprefix(fall) for k, _, _ in REWRITE_KEYS if k.startswith(fall)]
        rows = []
        for d in [*grid.domains, None]:
            sfx = f"/{d}" if d else ""
            n = float(zero.get(f"fedsd/rows{sfx}", 0))
            shares = [f"fedsd/kept_share{sfx}", *(f"{fall}{x}{sfx}" for x in reasons)]
            cells = [f"{n * float(zero.get(k, 0)):.0f}" for k in shares]
            share = num(zero.get(f"fedsd/kept_share{sfx}"))
            ratio = num(zero.get(f"fedsd/length_ratio{sfx}"), 2)
            rows.append([d or "all", f"{n:.0f}", *cells[:1], share, *cells[1:], ratio])
        header = ["domain", "rows", "kept", "kept share", *(f"fallback {x}" for x in reasons)]
        header.append("length ratio")
        cached = int(zero.get("fedsd/cached_clients", 0))
        values = {"method": m, "cached": cached, "clients": len(grid.domains)}
        parts.append(TEXT("rewrite-counts", values, vars(grid), table=table(header, rows)))
        if m == "fedsd":
            stats = [[label, num(float(zero[k]), dg)] for k, label, dg in REWRITE_KEYS if k in zero]
            parts.append(table(["statistic", "value"], stats))
    rule = {"keep_reasoning": "off" if grid.keep_reasoning is None else f"{grid.keep_reasoning:g}"}
    return joined(*parts, TEXT("fallbacks", rule) if parts else TEXT("no-rewrites"))


def _distributions(ctx: Context[Grid], res: Results) -> str | None:
    """The answer distributions' divergence between clients, raw and distilled."""
    if "fedsd" not in res.runs:
        return None
    dist = distribution_analysis(ctx.out / "fedsd", job_config(ctx.grid, "fedsd"))
    if "js_distilled" not in dist:
        return None
    rows = [
        [name, num(dist[f"{k}_raw"], 4), num(dist[f"{k}_distilled"], 4), f"{p[0]} → {p[1]}"]
        for name, k, p in (
            ("JS divergence between clients (bits)", "js", PAPER_JS),
            ("TF-IDF cosine between clients", "tfidf", PAPER_TFIDF),
        )
    ]
    return TEXT("distributions", rows=rows)


def _cosines(grid: Grid, res: Results) -> list[str]:
    """The clients' update cosines per round and the uplink bytes."""
    rounds = range(1, grid.rounds + 1)
    rows = []
    for m, r in res.ran():
        cos = {k: (a, b) for k, a, b in update_cosine_rows(r.metrics)}
        up = sorted({int(x.get("bytes_up_arrays", 0)) for x in r.metrics if int(x["round"])})
        cells = [f"{cos[k][0]:.3f} / {cos[k][1]:.3f}" if k in cos else DASH for k in rounds]
        rows.append([LABELS[m], *cells, ", ".join(f"{u:,}" for u in up)])
    return table(["method", *(f"round {k}" for k in rounds), "uplink array bytes / round"], rows)


def _personal(res: Results) -> str | None:
    """What the personal models are and which items each client scored on its own domain."""
    if "fedsdr" not in res.runs:
        return None
    if not res.personal:
        return TEXT("no-personal")
    seen = {
        c: sorted({it["domain"] for it in its if not it.get("zeroshot")})
        for c, its in res.personal.items()
    }
    own = "; ".join(f"client {c}: {', '.join(d) or DASH}" for c, d in sorted(seen.items()))
    return TEXT("personal", clients=len(res.personal), own=own)


def finish_commands(left: Sequence[str]) -> str:
    """The commands that run the jobs ``left``, one per part, in the order they must run."""
    parts = [p for p in PARTS if any(PART_OF[m] == p for m in left)]
    flags = ["--pilot" if p == "pilot" else f"--part {p}" for p in parts]
    return ", then ".join(f"`fedfm reproduce fedsdr {f}`" for f in flags)


def _pilot_verdict(grid: Grid, res: Results) -> str:
    if "fedit" not in res.runs or not res.has(BASE):
        return TEXT("pilot-missing")
    return TEXT("pilot-holds" if pilot_holds(grid, res.runs["fedit"]) else "pilot-fails")


def _pilot_table(grid: Grid, res: Results) -> list[str]:
    """The pilot's measures: base and FedIT levels, the paired difference and its MDE."""
    from fedfm.reproduce.stats import mde_of

    rows = []
    for m in PILOT_MEASURES:
        d = diff(res, "fedit", BASE, m, grid)
        lv = [level(res, x, m, grid).get("mean") for x in (BASE, "fedit")]
        rows.append([MEASURES[m][0], *(num(x) for x in lv), marked(d), num(mde_of(d)), d.n])
    header = ["measure", "base (round 0)", "FedIT", "FedIT − base", "MDE (2 SE)", "units"]
    return table(header, rows)


def body(ctx: Context[Grid], res: Results) -> str:
    """Setup, the instrument, kept ability and fidelity, update norms, rewrites, analyses."""
    grid = ctx.grid
    run_cfg, _, task = resolved(job_config(grid, "fedsdr"))
    t, tr = task.model_dump(), run_cfg.train.model_dump()
    setup = {"model": t["model"], "autocast": t.get("autocast_bf16"), "lora_r": t["lora"]["r"]}
    setup.update(targets=", ".join(t["lora"]["target_modules"]), batch_size=tr["batch_size"])
    computed = sorted({v.computed or "not recorded" for _, v in res.ran()})
    setup.update(local_optimizer=tr["optimizer"], lr=f"{grid.lr:g}")
    setup.update(computed=" and ".join(computed) or DASH)
    left = [m for m in METHODS if m not in res.runs]
    left += [PERSONAL] if "fedsdr" in res.runs and not res.personal else []
    missing = [f"`{m}`" for m in left]
    not_finished = TEXT("not-finished", missing=", ".join(missing), command=finish_commands(left))
    only_pilot = set(res.runs) <= {"fedit"}
    return TEXT(
        "body",
        vars(grid),
        setup,
        pilot_verdict=_pilot_verdict(grid, res),
        pilot_table=_pilot_table(grid, res),
        personal=_personal(res),
        main_missing=TEXT("no-main", command=ctx.command) if only_pilot else None,
        n_domains=len(grid.domains),
        domains=", ".join(grid.domains),
        zeroshot=", ".join(grid.zeroshot),
        zeroshot_tables=_zeroshot_tables(grid, res),
        trained_labels=_trained_labels(grid, res),
        lengths=_lengths(res),
        doc_tokens=_doc_tokens(grid, res),
        levels=_levels_table(grid, res),
        differences=_diff_table(grid, res),
        acc_domains=_diff_table(grid, res, "acc", grid.zeroshot),
        fidelity_domains=_diff_table(grid, res, "fidelity", grid.domains),
        norms=_norms(grid, res),
        matched=_matched(grid, res),
        rewrites=_rewrites(res, grid),
        distributions=_distributions(ctx, res),
        cosines=_cosines(grid, res),
        not_finished=not_finished if missing else None,
    )


STUDY = register(
    __name__,
    "FedSDR: kept ability and fidelity of FedIT, +FedSD, FedSDR, matched-drift FedIT",
    later="+FedSD, FedSDR and the matched-drift control run once the pilot (FedIT) shows"
    " forgetting; the control's lr once FedIT and +FedSD have measured their update norms;"
    " FedSDR's personal models (R + S) are scored from its final checkpoint after it",
)
