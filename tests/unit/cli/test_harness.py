"""``fedfm eval``: lm-evaluation-harness on a run's saved adapter, equal to fedfm's own scorer.

The local task ``fedfm_trec20`` (``tests/lm_eval_tasks``: a YAML, a jsonl and its loader) holds
20 TREC questions of the instruction suite; each choice is the label and the end-of-turn
marker, so the harness's ``acc`` is fedfm's ``choice_norm: none`` rule.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fedfm.config import load_config
from fedfm.harness import fedfm_choice_scores
from fedfm.runtime import run
from helpers import TESTS
from helpers.bases import INSTRUCTION
from helpers.cli import run_cli
from helpers.config import make_config, toy_yaml

pytest.importorskip("lm_eval")

TASKS = TESTS / "lm_eval_tasks"
ITEMS = [json.loads(x) for x in (TASKS / "trec20.jsonl").read_text().splitlines()]


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _same_up_to_a_constant(ours: list[list[float]], theirs: list[list[float]], tol: float) -> None:
    """Per document, the choices' log-likelihoods agree up to one shared term.

    The harness moves a prompt's trailing whitespace into every continuation (the newline
    after ``<|im_start|>assistant``), so its log-likelihoods add that newline's, the same for
    every choice of a document: the ranking (``acc``) is the same.
    """
    for a, b in zip(ours, theirs, strict=True):
        shift = b[0] - a[0]
        assert [x + shift for x in a] == pytest.approx(b, abs=tol)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    # Prompts long enough for the TREC questions: fedfm never cuts them, like the harness.
    cfg = load_config(
        make_config(
            INSTRUCTION,
            out,
            name="tiny",
            rounds=1,
            task={"prompt": {"max_length": 256, "max_prompt_length": 200}},
        )
    )
    run(cfg, progress=False)
    return out / "tiny"


def test_a_finished_llm_run_leaves_its_adapter_in_peft_format(tiny_run: Path) -> None:
    files = {p.name for p in (tiny_run / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    config = json.loads((tiny_run / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4


def test_fedfm_eval_on_a_tiny_run_equals_fedfm_scorer(tiny_run: Path, monkeypatch, capsys) -> None:
    argv = ["eval", str(tiny_run), "--tasks", "fedfm_trec20", "--include", str(TASKS)]
    code, out, err = run_cli([*argv, "--limit", "6"], monkeypatch, capsys)
    assert code == 0, err
    saved = json.loads((tiny_run / "lm_eval.json").read_text())
    assert saved["n_samples"]["fedfm_trec20"]["effective"] == 6 and saved["chat_template"]
    acc, logliks = fedfm_choice_scores(tiny_run, ITEMS[:6])
    assert saved["results"]["fedfm_trec20"]["acc"] == pytest.approx(acc)
    harness = [
        s["logliks"] for s in sorted(saved["samples"]["fedfm_trec20"], key=lambda s: s["doc_id"])
    ]
    _same_up_to_a_constant(logliks, harness, 1e-3)
    assert f"fedfm_trec20: acc={acc:.4f}" in out
    page = (tiny_run / "report.html").read_text()
    assert "<h2>lm-evaluation-harness" in page and "<td>fedfm_trec20</td>" in page


def test_bad_eval_input_is_one_line_exit_2_and_the_run_untouched(
    tiny_run: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    before = _snapshot(tiny_run)
    code, _, err = run_cli(["eval", str(tmp_path), "--tasks", "x"], monkeypatch, capsys)
    assert (code, err.strip()) == (
        2,
        f"error: config error: run: {tmp_path} is not a finished run folder (no config.yaml)",
    )
    # A finished run whose algorithm trains no LoRA adapter (a toy regression).
    code, _, err = run_cli(["run", str(toy_yaml(tmp_path)), "-q"], monkeypatch, capsys)
    toy = tmp_path / "runs" / "c"
    assert code == 0 and not (toy / "adapter").exists()
    code, _, err = run_cli(["eval", str(toy), "--tasks", "x"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: config error: run: {toy} has no adapter (adapter/adapter_config.json): only"
        " finished runs of an LLM algorithm that trains a global LoRA adapter leave one"
    ]
    code, _, err = run_cli(["eval", str(tiny_run), "--tasks", "nosuchtask"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: config error: --tasks: lm-eval knows no task ['nosuchtask']"
    )
    # A task of the harness whose data lives on the hub: it cannot be loaded offline.
    code, _, err = run_cli(["eval", str(tiny_run), "--tasks", "arc_easy"], monkeypatch, capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(
        "error: config error: --tasks: ['arc_easy'] cannot be loaded offline:"
    )
    assert _snapshot(tiny_run) == before


def test_fedfm_eval_on_a_run_with_lora_on_the_tied_head(tmp_path: Path, monkeypatch, capsys):
    """The tiny model ties its head to its embeddings; LoRA on the head leaves it wrapped."""
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            name="head",
            rounds=1,
            task={
                "lora": {"target_modules": ["q_proj", "v_proj", "lm_head"]},
                "prompt": {"max_length": 256, "max_prompt_length": 200},
            },
        )
    )
    run(cfg, progress=False)
    argv = ["eval", str(tmp_path / "head"), "--tasks", "fedfm_trec20", "--include", str(TASKS)]
    code, _, err = run_cli([*argv, "--limit", "2"], monkeypatch, capsys)
    assert code == 0, err
    saved = json.loads((tmp_path / "head" / "lm_eval.json").read_text())
    assert len(saved["samples"]["fedfm_trec20"]) == 2


@pytest.mark.slow
def test_fedfm_eval_on_smollm2_equals_fedfm_scorer(tmp_path: Path, monkeypatch, capsys) -> None:
    """Base SmolLM2 (a 0-round run: its adapter is the untrained B = 0 init) on all 20 items."""
    cfg = load_config(
        make_config(
            INSTRUCTION,
            tmp_path,
            name="smol",
            rounds=0,
            task={
                "model": "smollm2-135m-instruct",
                "model_args": {},
                "choice_mode": "loglik",
                "eval_ppl": False,
                "max_eval": 3,
            },
        )
    )
    run(cfg, progress=False)
    folder = tmp_path / "smol"
    argv = ["eval", str(folder), "--tasks", "fedfm_trec20", "--include", str(TASKS)]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 0, err
    saved = json.loads((folder / "lm_eval.json").read_text())
    acc, logliks = fedfm_choice_scores(folder, ITEMS)
    harness_acc = saved["results"]["fedfm_trec20"]["acc"]
    print(f"fedfm_trec20 on base SmolLM2: lm-eval acc {harness_acc}, fedfm acc {acc}")
    assert saved["results"]["fedfm_trec20"]["acc"] == pytest.approx(acc)
    harness = [
        s["logliks"] for s in sorted(saved["samples"]["fedfm_trec20"], key=lambda s: s["doc_id"])
    ]
    _same_up_to_a_constant(logliks, harness, 2e-3)
