"""The ``fedfm`` command: run, report, analyze, eval, reproduce, list, and the Flower commands.

Errors that fedfm raises on purpose print one line and exit with code 2 (bad config or
input) or 1 (a run that failed, e.g. too few clients survived a round); no traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedfm.errors import ConfigError, FedfmError
from fedfm.runtime.flower import commands as flower_commands

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False
)


def _offline_defaults() -> None:
    # Offline assets ship inside packages; never let a library reach for a hub by surprise.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@app.command()
def run(
    config: Annotated[str, typer.Argument(help="preset name or YAML file")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from the last checkpoint")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace an existing run folder")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress display")] = False,
) -> None:
    """Run an experiment and write runs/<name>/."""
    from fedfm.algorithms import algo_keys
    from fedfm.config import load_run_config
    from fedfm.runtime import run as run_config

    cfg = load_run_config(config, overrides or [], resume, algo_keys)
    from fedfm.plan import make_plan, plan_fits_or_warn

    plan = make_plan(cfg)
    Console().print(plan.summary(), soft_wrap=True, markup=False)
    plan_fits_or_warn(plan, strict=False)
    if cfg.torch_device().type != "cpu":
        logging.getLogger("fedfm").warning(
            "device %s: the plan is sized for it, but training, generation and evaluation"
            " still compute on the CPU",
            cfg.device,
        )
    summary = run_config(cfg, resume=resume, overwrite=overwrite, progress=not quiet)
    from fedfm.progress import summary_line

    Console().print(summary_line(summary, Path(cfg.out_dir) / cfg.name))


@app.command()
def plan(
    config: Annotated[str, typer.Argument(help="preset name or YAML file")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="exit 2 when the run does not fit the device")
    ] = False,
) -> None:
    """Print a run's memory plan (server and client: parameters, peak memory by part, bytes
    per round) and whether it fits its device; loads no weights, writes nothing."""
    from fedfm.algorithms import algo_keys
    from fedfm.config import load_config
    from fedfm.plan import make_plan, plan_fits_or_warn

    made = make_plan(load_config(config, overrides or [], algo_keys))
    print(made.table())
    plan_fits_or_warn(made, strict)


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="run folders")],
    out: Annotated[
        Path | None,
        typer.Option(
            help="folder for compare.md and compare.png (default: compare/ next to the first run)"
        ),
    ] = None,
    html: Annotated[
        bool, typer.Option("--html", help="also write one self-contained report.html there")
    ] = False,
) -> None:
    """Compare runs: a markdown table of final metrics and bytes, and a plot."""
    from fedfm.report import compare, default_out

    folder = out or default_out(runs)
    print(compare(runs, folder))
    print(f"wrote {folder / 'compare.md'} and {folder / 'compare.png'}")
    if html:
        from fedfm.html_report import write_html

        page = write_html(runs, folder / "report.html")
        Console().print(f"html report written: {page}")


@app.command()
def analyze(
    runs: Annotated[list[Path], typer.Argument(help="run folders (the first is the reference)")],
) -> None:
    """FedSDR's analyses of finished runs: answer distributions raw vs distilled, update
    cosines per round, rewrite statistics; with several runs, win rates over the first."""
    from fedfm.analyze import analyze as analyze_runs

    print(analyze_runs(runs))


@app.command("eval")
def eval_(
    run: Annotated[Path, typer.Argument(help="a finished run folder with adapter/")],
    tasks: Annotated[str, typer.Option("--tasks", help="lm-eval tasks, comma-separated")],
    limit: Annotated[
        int | None, typer.Option("--limit", help="documents per task (the first ones)")
    ] = None,
    include: Annotated[
        list[Path] | None,
        typer.Option("--include", help="a folder of lm-eval task YAML files (repeatable)"),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="sequences per pass")] = 8,
) -> None:
    """Evaluate a run's global adapter with lm-evaluation-harness (the fedfm[lmeval] extra):
    writes RUN/lm_eval.json and adds the scores to RUN/report.html."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("--tasks", "needs lm-evaluation-harness: pip install 'fedfm[lmeval]'")
    from fedfm.harness import evaluate_run, format_results, parse_tasks

    out = evaluate_run(run, parse_tasks(tasks), limit, include or [], batch_size)
    print(format_results(out))
    print(f"wrote {run / 'lm_eval.json'} and {run / 'report.html'}")


@app.command()
def reproduce(
    study: Annotated[str, typer.Argument(help="study name, e.g. fedekd")],
    out: Annotated[
        Path, typer.Option(help="folder of the study folders (runs and study.json)")
    ] = Path("runs/reproduce"),
    quick: Annotated[bool, typer.Option("--quick", help="a small grid for a smoke check")] = False,
    jobs: Annotated[
        int | None, typer.Option("--jobs", min=1, help="worker processes (default: the study's)")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="list the jobs and estimate their wall time")
    ] = False,
    report_dir: Annotated[
        Path | None, typer.Option(help="folder of the report (default: the study's, docs/)")
    ] = None,
) -> None:
    """Run a reproduction study and write its markdown report (readouts first)."""
    from fedfm.reproduce.framework import reproduce as run_study

    result = run_study(study, out, quick, jobs, dry_run, report_dir)
    if isinstance(result, list):
        print("\n".join(result))
    else:
        Console().print(f"report written: {result}")


@app.command("list")
def list_() -> None:
    """Show algorithms, tasks, datasets, partitioners, models, server optimizers, robust
    aggregators and presets, each with the key=value that selects it."""
    import fedfm.algorithms
    import fedfm.tasks  # noqa: F401
    from fedfm.algorithms.base import ALGORITHMS
    from fedfm.config import preset_names
    from fedfm.core.optim import SERVER_OPTIMIZERS
    from fedfm.core.robust import AGGREGATORS, AggregatorConfig
    from fedfm.data.partition import PARTITIONERS
    from fedfm.data.sources import SOURCES
    from fedfm.models.registry import MODELS, load_builtin_models
    from fedfm.tasks.base import TASKS

    load_builtin_models()
    out = Console()
    for title, key, reg in [
        ("algorithms", "algorithm", ALGORITHMS),
        ("tasks", "task.kind", TASKS),
        ("datasets", "task.dataset", SOURCES),
        ("partitioners", "partition.scheme", PARTITIONERS),
        ("models", "task.model", MODELS),
        ("server optimizers", "algo.server_opt.name", SERVER_OPTIMIZERS),
        ("robust aggregators", "algo.aggregator.name", AGGREGATORS),
    ]:
        table = Table(title=f"{title}: {key}=NAME", show_edge=False, title_justify="left")
        table.add_column("name")
        table.add_column("description")
        for name, help_ in reg.describe():
            table.add_row(name, help_)
        out.print(table)
        if reg is SERVER_OPTIMIZERS:
            # One line however many algorithms there are (soft_wrap: no hard line breaks).
            out.print(f"used by: {', '.join(_aggregating('server_opt'))}\n", soft_wrap=True)
        if reg is AGGREGATORS:
            out.print(f"used by: {', '.join(_aggregating('aggregator'))}", soft_wrap=True)
            opts = Table(title="aggregator options", show_edge=False, title_justify="left")
            opts.add_column("key=VALUE")
            opts.add_column("meaning")
            for k, f in AggregatorConfig.model_fields.items():
                if k != "name":
                    opts.add_row(f"algo.aggregator.{k}=", f.description or "")
            out.print(opts)
    out.print(_recipe_table())
    out.print("[bold]presets[/]: " + ", ".join(preset_names()))


def _recipe_table() -> Table:
    """The device and the LLM recipe knobs (FlowerTune's), with the values each takes."""
    import importlib.util
    from typing import get_args

    from fedfm.config import BNB_OPTIMIZERS, LrSchedule, TrainConfig
    from fedfm.devices import DEVICE_NAMES

    bnb = "installed" if importlib.util.find_spec("bitsandbytes") else "not installed"
    optimizers = get_args(TrainConfig.model_fields["optimizer"].annotation)
    rows = [
        ("device=", " | ".join(DEVICE_NAMES), "auto: CUDA when present, else the CPU"),
        ("train.optimizer=", " | ".join(optimizers), f"{', '.join(BNB_OPTIMIZERS)}: CUDA"),
        ("train.schedule.name=", " | ".join(get_args(LrSchedule.model_fields["name"].annotation)),
         "clients' local lr over rounds (cosine: FlowerTune's cosine_annealing)"),
        ("train.schedule.min_lr=", "number <= train.lr", "where cosine ends"),
        ("train.schedule.warmup_rounds=", "integer < rounds", "linear warm-up to train.lr"),
        ("task.lora.target_modules=", "\\[names] | auto | all-linear",
         "auto: peft's default attention projections of the architecture"),
        ("task.lora.use_dora=", "true | false", "DoRA: magnitude + direction (peft)"),
        ("task.quantization=", "4bit | 8bit", "QLoRA NF4 / LLM.int8 base: CUDA"),
    ]  # fmt: skip
    table = Table(
        title=f"devices and LLM recipe options (bitsandbytes {bnb})",
        show_edge=False,
        title_justify="left",
    )
    table.add_column("key=VALUE", no_wrap=True)
    table.add_column("values")
    table.add_column("meaning")
    for row in rows:
        table.add_row(*row)
    return table


def _aggregating(field: str) -> list[str]:
    """Algorithms that aggregate client tensors and whose config has ``field``."""
    from fedfm.algorithms.base import ALGORITHMS

    out = []
    for name in ALGORITHMS:
        algo = ALGORITHMS.get(name)
        sends = any(kind.up_arrays for kind in algo.messages)
        if sends and field in algo.Config.model_fields:
            out.append(name)
    return out


app.command("serve")(flower_commands.serve)
app.command("client")(flower_commands.client)
app.command("flower-app")(flower_commands.flower_app)
app.command("flower-certs")(flower_commands.flower_certs)


def main() -> None:
    """Entry point: run the app, turning fedfm errors into one line and an exit code."""
    _offline_defaults()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        # Without standalone mode, click returns a command's typer.Exit code instead of
        # exiting with it (e.g. `fedfm client` refused: 2, stopped by SIGTERM: 143).
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FedfmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code or 0)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
