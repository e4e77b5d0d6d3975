"""``fedfm eval RUN --tasks T1,T2``: the field's evaluator on a finished run's global adapter.

A finished LLM run leaves its global LoRA adapter in peft's format in ``RUN/adapter/``. This
module loads the run's base model with fedfm's own loader (:class:`fedfm.fm.FoundationModel`,
the same dtype, LoRA settings and bfloat16 autocast as the run), applies that adapter, and hands
the model object to lm-evaluation-harness (Gao et al., "A framework for few-shot language
model evaluation", ``lm-eval`` 0.4.x, the ``fedfm[lmeval]`` extra) through its ``HFLM``
wrapper, in this process. Prompts go through the tokenizer's chat template when the run's
prompts did (``task.prompt.use_chat_template``), with the run's system message, as in fedfm's
own evaluation. The results go to ``RUN/lm_eval.json`` (per task and metric, and every scored
document's log-likelihoods) and into the run's ``report.html``.

Everything is checked before the run folder is touched: a folder that is not a finished run,
a run without an adapter, and task names that the harness cannot find or load offline are one
line each (:class:`fedfm.errors.ConfigError`, exit code 2).

lm-eval's multiple-choice ``acc`` is the argmax of each choice's summed log-likelihood, fedfm's
``choice_norm: none``; a task whose choices end with the end-of-turn marker (as
``tests/lm_eval_tasks`` does) scores exactly what fedfm's scorer does. Its ``acc_norm``
divides by the choice's characters and ``acc_bytes`` by its UTF-8 bytes (fedfm's ``bytes``);
the two agree for ASCII labels.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedfm.errors import ConfigError

OUT = "lm_eval.json"
ADAPTER = "adapter"
EVAL_ADAPTER = "lm_eval"
"""Name of the adapter slot the run's adapter is loaded into."""


def check_run(run: Path) -> dict[str, Any]:
    """The run's config, once ``run`` is known to be a finished run with an adapter.

    Raises:
        ConfigError: Field ``run``: not a folder, not a finished run, or no adapter.
    """
    import yaml

    if not run.is_dir():
        raise ConfigError("run", f"{run} is not a folder")
    for name in ("config.yaml", "summary.json"):
        if not (run / name).is_file():
            raise ConfigError("run", f"{run} is not a finished run folder (no {name})")
    if not (run / ADAPTER / "adapter_config.json").is_file():
        raise ConfigError(
            "run",
            f"{run} has no adapter ({ADAPTER}/adapter_config.json): only finished runs of an"
            " LLM algorithm that trains a global LoRA adapter leave one",
        )
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    if not isinstance(cfg, dict):
        raise ConfigError("run", f"{run}/config.yaml is not a run config")
    return cfg


def parse_tasks(tasks: str) -> list[str]:
    """``"a,b"`` → ``["a", "b"]``.

    Raises:
        ConfigError: Field ``--tasks``: no task named.
    """
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError("--tasks", "name at least one lm-eval task, e.g. --tasks arc_easy")
    return names


def load_tasks(names: Sequence[str], include: Sequence[Path]) -> tuple[Any, dict[str, Any]]:
    """The harness's task manager and its loaded tasks (datasets included).

    Args:
        names: Task (or group) names.
        include: Folders of task YAML files beside the harness's own tasks.

    Raises:
        ConfigError: Field ``--tasks``: a name is unknown, or its data cannot be loaded here
            (offline: nothing can be downloaded).
    """
    from lm_eval.tasks import TaskManager, get_task_dict

    for folder in include:
        if not folder.is_dir():
            raise ConfigError("--include", f"{folder} is not a folder of task YAML files")
    manager = TaskManager(include_path=[str(p) for p in include] or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f" (also searched {', '.join(map(str, include))})" if include else ""
        raise ConfigError("--tasks", f"lm-eval knows no task {unknown}{where}")
    try:
        loaded = get_task_dict(list(names), manager)
    except Exception as e:  # datasets raises many kinds when offline or missing
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(
            "--tasks", f"{list(names)} cannot be loaded offline: {type(e).__name__}: {reason}"
        ) from None
    return manager, loaded


def load_model(cfg: dict[str, Any], run: Path) -> Any:
    """The run's foundation model with its saved adapter active (fedfm's loader)."""
    from fedfm.config import load_config
    from fedfm.engine import resolve
    from fedfm.tasks.lm import InstructionConfig, foundation_model_for

    run_cfg = load_config(cfg)
    _, task_cfg = resolve(run_cfg)
    if not isinstance(task_cfg, InstructionConfig):
        raise ConfigError("run", f"task.kind '{task_cfg.kind}' has no causal LM to evaluate")
    fm = foundation_model_for(task_cfg, run_cfg.torch_device())
    if fm.has_adapter(EVAL_ADAPTER):  # an earlier run's, evaluated in this process: its shape
        fm.delete_adapter(EVAL_ADAPTER)  # may differ (other LoRA settings)
    fm.read_adapter(EVAL_ADAPTER, run / ADAPTER)
    fm.set_active([EVAL_ADAPTER])
    return fm


@contextlib.contextmanager
def _ties_kept(model: Any) -> Any:
    """Keeps the model's weights tied as they were loaded while lm-eval wraps it.

    ``HFLM`` re-ties the input and output embeddings of the model it is given; with LoRA on
    a tied output layer (``lm_head`` in ``target_modules``) that fails, since peft's layer
    wrapper has a read-only ``weight``. The loaded model is tied already, so the call is
    shadowed on the instance for the wrap.
    """
    model.tie_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.tie_weights


def evaluate_run(
    run: Path,
    tasks: Sequence[str],
    limit: int | None = None,
    include: Sequence[Path] = (),
    batch_size: int = 8,
    autocast: bool = True,
) -> dict[str, Any]:
    """Runs lm-eval on the run's adapter, writes ``RUN/lm_eval.json`` and the report.

    Args:
        run: A finished run folder with ``adapter/``.
        tasks: lm-eval task names.
        limit: Documents per task (the first ones); ``None``: all.
        include: Extra folders of task YAML files.
        batch_size: Sequences per forward pass.
        autocast: The run's bfloat16 autocast (when it used one); ``False``: float32. Under
            bfloat16 a log-likelihood depends on the batch it was computed in (rounding of
            padded shapes), so only float32 scores equal fedfm's to a few 1e-3.

    Returns:
        What ``lm_eval.json`` holds.

    Raises:
        ConfigError: See :func:`check_run` and :func:`load_tasks`; ``limit`` below 1.
    """
    if limit is not None and limit < 1:
        raise ConfigError("--limit", f"must be >= 1, got {limit}")
    cfg = check_run(run)
    manager, loaded = load_tasks(tasks, include)
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from fedfm.data.prompt import uses_chat_template

    fm = load_model(cfg, run)
    with _ties_kept(fm.model):
        lm = HFLM(pretrained=fm.model, tokenizer=fm.tokenizer, batch_size=batch_size)
    chat = uses_chat_template(fm.tokenizer, fm.prompt_cfg)
    with fm.autocast() if autocast else contextlib.nullcontext():
        res = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            apply_chat_template=chat,
            system_instruction=fm.prompt_cfg.system if chat else None,
            log_samples=True,
            bootstrap_iters=0,
        )
    del loaded  # loaded once above only to refuse missing data before any work
    out = {
        "lm_eval": getattr(lm_eval, "__version__", "?"),
        "tasks": list(tasks),
        "limit": limit,
        "adapter": ADAPTER,
        "chat_template": chat,
        "autocast_bf16": bool(autocast and fm.autocast_bf16),
        "results": _numbers(res.get("results", {})),
        "n_samples": res.get("n-samples", {}),
        "samples": {t: [_sample(s) for s in rows] for t, rows in res.get("samples", {}).items()},
    }
    _write_json(run / OUT, out)
    _refresh_report(run)
    return out


def _numbers(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per task, its numeric results (``acc,none`` → ``acc``; stderr kept as ``acc_stderr``)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        row: dict[str, float] = {}
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if numeric and name != "sample_len":  # sample_len: documents, in n_samples
                row[name] = float(value)
        out[task] = row
    return out


def _sample(s: dict[str, Any]) -> dict[str, Any]:
    """One scored document: its id, target, each choice's log-likelihood and its metrics."""
    resps = s.get("filtered_resps") or []
    logliks = [float(r[0]) for r in resps if isinstance(r, list | tuple) and r]
    metrics = {k: float(s[k]) for k in ("acc", "acc_norm", "acc_bytes") if k in s}
    return {"doc_id": s.get("doc_id"), "target": s.get("target"), "logliks": logliks, **metrics}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def _refresh_report(run: Path) -> None:
    """Rewrites the run's ``report.html`` with the harness's scores in it."""
    from fedfm.core.runfolder import read_json
    from fedfm.html_report import write_run_report

    write_run_report(run, read_json(run / "summary.json"))


def format_results(out: dict[str, Any]) -> str:
    """A short text table of ``lm_eval.json``'s results."""
    lines = []
    for task, metrics in out["results"].items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if not k.endswith("stderr"))
        n = out.get("n_samples", {}).get(task, {}).get("effective")
        lines.append(f"{task}: {shown}" + (f" ({n} documents)" if n else ""))
    return "\n".join(lines)


def fedfm_choice_scores(
    run: Path, docs: Sequence[dict[str, Any]], autocast: bool = True
) -> tuple[float, list[list[float]]]:
    """Fedfm's own scorer on a local multiple-choice task, with the run's adapter.

    What ``fedfm eval``'s numbers are checked against: the documents of a task in the
    instruction suite's schema (``id``, ``instruction``, ``input``, ``choices``, ``gold``, as in
    ``tests/lm_eval_tasks``) scored by :func:`fedfm.eval.llm.evaluate_instruction_items` with
    ``choice_norm: none``, under the run's autocast or (``autocast=False``) in float32.

    Returns:
        The accuracy, and per document each choice's summed log-likelihood (label and
        end-of-turn marker) in the order of ``choices``.
    """
    import datasets

    from fedfm.data.prompt import format_prompt
    from fedfm.eval.llm import choice_logliks, evaluate_instruction_items

    labels = [d["choices"][d["gold"]] for d in docs]
    rows = datasets.Dataset.from_dict(
        {
            "id": [d["id"] for d in docs],
            "instruction": [d["instruction"] for d in docs],
            "input": [d["input"] for d in docs],
            "output": labels,
            "answer": labels,
            "choices": [d["choices"] for d in docs],
            "domain": ["local"] * len(docs),
            "metric": ["choice"] * len(docs),
        }
    )
    fm = load_model(check_run(run), run)
    with fm.autocast() if autocast else contextlib.nullcontext():
        metrics, _ = evaluate_instruction_items(
            fm.model,
            fm.tokenizer,
            rows,
            prompt=fm.prompt_cfg,
            choice_mode="loglik",
            choice_norm="none",
        )
        logliks = [
            [
                sc.loglik
                for sc in choice_logliks(
                    fm.model,
                    fm.tokenizer,
                    format_prompt(fm.tokenizer, d["instruction"], d["input"], fm.prompt_cfg),
                    d["choices"],
                    prompt_cfg=fm.prompt_cfg,
                )
            ]
            for d in docs
        ]
    return float(metrics["acc"]), logliks
