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
    # transformers' loading and saving bars ("Loading weights") are not a run's progress;
    # HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


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
    from fedfm.config import load_run_config
    from fedfm.runtime import run as run_config

    cfg = load_run_config(config, overrides or [], resume, flower_commands.algo_keys)
    import fedfm.integrations  # noqa: F401  (the hf_trainer task; after the cheap checks)
    from fedfm.devices import describe
    from fedfm.plan import make_plan, plan_fits_or_warn
    from fedfm.progress import announce_at_start, summary_line

    plan = make_plan(cfg)
    device = f"device {cfg.device}: {describe(cfg.torch_device())}"

    def announce() -> None:  # printed once every check has passed (one line if refused)
        Console().print(plan.summary(), soft_wrap=True, markup=False)
        plan_fits_or_warn(plan, strict=False)
        Console().print(device, markup=False)

    with announce_at_start(announce):
        summary = run_config(cfg, resume=resume, overwrite=overwrite, progress=not quiet)

    Console().print(
        summary_line(summary, Path(cfg.out_dir) / cfg.name), soft_wrap=True, markup=False
    )


@app.command()
def plan(
    config: Annotated[str, typer.Argument(help="preset name or YAML file")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides")] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="exit 2 when the run does not fit the device")
    ] = False,
) -> None:
    """Print a run's memory plan and whether it fits its device.

    Server and client: parameters, peak memory by part, bytes per round. Loads no weights, writes
    nothing.
    """
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
    """FedSDR's analyses of finished runs.

    Answer distributions raw vs distilled, update cosines per round, rewrite statistics; with
    several runs, win rates over the first.
    """
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
    float32: Annotated[
        bool, typer.Option("--float32", help="without the run's bfloat16 autocast")
    ] = False,
) -> None:
    """Evaluate a run's global adapter with lm-evaluation-harness (the fedfm[lmeval] extra).

    Writes RUN/lm_eval.json and adds the scores to RUN/report.html.
    """
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("--tasks", "needs lm-evaluation-harness: pip install 'fedfm[lmeval]'")
    from fedfm.harness import evaluate_run, format_results, parse_tasks

    out = evaluate_run(
        run, parse_tasks(tasks), limit, include or [], batch_size, autocast=not float32
    )
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
    pilot: Annotated[
        bool, typer.Option("--pilot", help="only the study's premise pilot (its first readout)")
    ] = False,
    part: Annotated[
        str | None,
        typer.Option(help="only this part's jobs (a study too long for one command has parts)"),
    ] = None,
) -> None:
    """Run a reproduction study and write its markdown report (readouts first)."""
    from fedfm.reproduce.framework import reproduce as run_study

    result = run_study(study, out, quick, jobs, dry_run, report_dir, pilot, part)
    if isinstance(result, list):
        print("\n".join(result))
    else:
        Console().print(f"report written: {result}")


@app.command("list")
def list_() -> None:
    """Show everything a run config can name, with the key=value that selects it.

    Show algorithms, tasks, datasets, partitioners, models, server optimizers, robust
    aggregators and presets, each with the key=value that selects it.
    """
    from fedfm.catalog import load, render

    render(load(), Console())


app.command("serve")(flower_commands.serve)
app.command("client")(flower_commands.client)
app.command("flower-app")(flower_commands.flower_app)
app.command("flower-certs")(flower_commands.flower_certs)


def main() -> None:
    """Entry point: run the app, turning fedfm errors into one line and an exit code."""
    from fedfm.allocator import AllocatorError, relaunch_if_wanted

    try:
        relaunch_if_wanted()  # a training command starts again with jemalloc, where found
    except AllocatorError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
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
