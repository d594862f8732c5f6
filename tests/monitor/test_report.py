"""``skylift report``: a real preempted-and-resumed run, checked in headless Chromium;
synthetic records for what a CPU run cannot write (GPUs, prices)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from skylift.cli.main import main
from skylift.monitor import plots
from skylift.monitor.attempts import split_attempts
from skylift.monitor.report import SECTION_IDS, find_diagnosis, write_report
from skylift.monitor.schema import read_records, validate_record
from tests.monitor.browser import open_page
from tests.monitor.synthetic import PREEMPTED_AT, synthetic_records, write_run

IMAGES_LOADED = "Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length"


def assert_not_blank(png: bytes) -> None:
    """Plots on the page: the pixels vary, and a fair share of them are not the background."""
    image = Image.open(io.BytesIO(png)).convert("L")
    assert max(ImageStat.Stat(image).stddev) > 20, "the screenshot is (nearly) one colour"
    histogram = image.histogram()
    background = max(histogram)
    assert 1 - background / sum(histogram) > 0.05, "the screenshot is almost all background"


def assert_every_section(dom: str) -> None:
    for section_id in SECTION_IDS:
        assert re.search(rf'<section id="{section_id}"><h2>[^<]+</h2>', dom), f"section {section_id!r} is missing"


# -- the real run, in a real browser ---------------------------------------------------


def test_report_of_a_preempted_and_resumed_run_renders_in_chromium(preempted_run, chromium, capsys, tmp_path):
    records = list(read_records(preempted_run / "metrics.jsonl"))
    attempts = split_attempts(records)
    assert len(attempts) == 2 and attempts[0].outcome == "preempted", [a.outcome for a in attempts]

    capsys.readouterr()
    code = main(["report", str(preempted_run), "--json"])  # in-process: no process boundary is under test
    printed, errors = capsys.readouterr()
    assert code == 0, errors
    produced = json.loads(printed)
    html_path = Path(produced["html"])
    assert html_path == preempted_run / "report" / "index.html"
    assert {Path(p).name for p in produced["pngs"]} >= {"loss.png", "throughput.png", "breakdown.png", "timeline.png"}
    for png in produced["pngs"]:
        assert Image.open(png).size[0] >= 800
    page_source = html_path.read_text()
    assert not re.search(r'(src|href)="(https?:)?//', page_source), "the report must not reach the network"

    page = open_page(html_path.as_uri(), expressions=(IMAGES_LOADED,))
    (tmp_path / "screenshot.png").write_bytes(page.screenshot_png)
    assert page.errors == [], page.console
    assert_not_blank(page.screenshot_png)
    assert_every_section(page.dom)
    assert page.values[0] == len(produced["pngs"]), "an embedded PNG did not decode"
    timeline = page.dom.split('<section id="timeline">', 1)[1]
    stopped_at = next(r for r in records if r["kind"] == "preemption")["step"]
    assert "preempted (preemption notice)" in timeline
    assert f"step {stopped_at}" in timeline, "the resume is not in the attempts table"


def test_the_browser_check_catches_console_errors_exceptions_and_blank_pages(chromium, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text('<!doctype html><html><head><link rel="icon" href="data:,"></head><body>'
                      '<img src="missing.png"><script>console.log("fine");console.error("boom: console.error");'
                      'throw new Error("boom: uncaught");</script></body></html>')
    page = open_page(broken.as_uri(), full_page=False)
    errors = "\n".join(page.errors)
    assert "boom: console.error" in errors
    assert "boom: uncaught" in errors
    assert "Failed to load resource" in errors
    assert "fine" not in errors, "a console.log is not an error"
    with pytest.raises(AssertionError, match="one colour"):
        assert_not_blank(page.screenshot_png)
    with pytest.raises(AssertionError, match="section 'summary' is missing"):
        assert_every_section(page.dom)


def test_a_folder_without_metrics_names_the_path_and_the_next_command(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert str(tmp_path / "nowhere" / "metrics.jsonl") in message[0]
    assert message[-1].startswith("Next: skylift ")


# -- synthetic records -----------------------------------------------------------------


def test_synthetic_records_follow_the_schema():
    for record in synthetic_records():
        validate_record(record)


@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory) -> tuple[Path, list[str]]:
    """``skylift report`` of the synthetic run: (run folder, printed lines)."""
    run_dir = write_run(tmp_path_factory.mktemp("synthetic") / "run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", str(run_dir)]) == 0
    return run_dir, printed.getvalue().splitlines()


def test_report_prints_the_path_and_the_diagnosis(synthetic_report):
    run_dir, lines = synthetic_report
    assert lines[0] == f"report: {run_dir / 'report' / 'index.html'}"
    assert lines[1] == "diagnosis: bound: compute (step time: forward_backward 60%, data_wait 20%, communication 10%)"
    assert lines[2] == "diagnosis: [warn] data wait is 20% of step time -> set data.num_workers: 8"


def test_gpu_cost_and_diagnosis_sections_from_synthetic_records(synthetic_report):
    report_dir = synthetic_report[0] / "report"
    assert {p.name for p in report_dir.glob("*.png")} == {f"{s}.png" for s in SECTION_IDS
                                                          if s not in ("summary", "diagnosis")}
    page = (report_dir / "index.html").read_text()
    assert_every_section(page)
    assert "no cost records" not in page and "no system records" not in page and "no GPU" not in page
    assert "Bound by <b>compute</b>" in page and "set data.num_workers: 8" in page
    assert "2 (1 preempted)" in page
    assert f"step {PREEMPTED_AT}" in page.split('id="timeline"', 1)[1]


def test_gpu_figure_draws_each_gpu_and_breaks_lines_over_the_downtime():
    attempts = split_attempts(synthetic_records())
    figure = plots.utilization_figure(attempts, plots.TimeAxis(attempts))
    util_ax, memory_ax = figure.axes
    assert util_ax.get_legend_handles_labels()[1] == ["CPU", "GPU 0", "GPU 1"]
    assert memory_ax.get_legend_handles_labels()[1] == ["host RAM", "GPU 0", "GPU 1"]
    gpu0_x = util_ax.get_lines()[1].get_xdata()
    assert any(math.isnan(x) for x in gpu0_x), "no NaN gap between the two attempts"


def test_many_gpus_are_summarised_as_mean_and_band():
    records = synthetic_records()
    for record in records:
        if record["kind"] == "system":
            record["gpus"] = [{**record["gpus"][0], "index": i} for i in range(16)]
    attempts = split_attempts(records)
    util_ax, _ = plots.utilization_figure(attempts, plots.TimeAxis(attempts)).axes
    assert util_ax.get_legend_handles_labels()[1] == ["CPU", "GPU mean of 16"]


def test_cost_figure_draws_spend_and_projection():
    records = [r for r in synthetic_records() if r["kind"] != "run_end"]
    last = [r for r in records if r["kind"] == "cost"][-1]
    last.update(projected_usd_total=0.5, projected_s_left=3600.0)
    attempts = split_attempts(records)
    axis = plots.TimeAxis(attempts)
    spent_ax, _ = plots.cost_figure(attempts, axis).axes
    projection = next(line for line in spent_ax.get_lines() if line.get_label().startswith("projection"))
    assert projection.get_label() == "projection: $0.5000 at the end"
    assert projection.get_xdata()[-1] == pytest.approx(axis(last["time"] + 3600.0))
    assert projection.get_ydata()[-1] == 0.5


def test_every_label_stays_inside_its_figure():
    """The figures have fixed margins, not a layout measured at each draw: every title, tick
    label, axis label, annotation and legend must still fit in the figure and clear the panel
    beside it, with 7-digit throughput ticks (the widest the margins are sized for) and every
    step phase named beside its bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    records = synthetic_records()
    for record in records:
        if record["kind"] == "train":
            record["samples_per_s"] = 2_500_000.0 + 1000 * (record["step"] % 7)
    attempts = split_attempts(records)
    axis = plots.TimeAxis(attempts)
    figures = [plots.loss_figure(attempts), plots.throughput_figure(attempts), plots.utilization_figure(attempts, axis),
               plots.breakdown_figure(attempts), plots.cost_figure(attempts, axis), plots.timeline_figure(attempts, axis)]
    for figure in figures:
        renderer = FigureCanvasAgg(figure).get_renderer()
        figure.draw(renderer)
        # What each panel drew, its labels and legend included (what a constrained layout fits).
        drawn = [ax.get_tightbbox(renderer) for ax in figure.axes]
        for ax, box in zip(figure.axes, drawn, strict=True):
            # Half a pixel: Agg places text on whole pixels.
            assert box.x0 >= -0.5 and box.y0 >= -0.5, (ax.get_title(), box)
            assert box.x1 <= figure.bbox.x1 + 0.5 and box.y1 <= figure.bbox.y1 + 0.5, (ax.get_title(), box)
        for left, left_box, right_box in zip(figure.axes, drawn, drawn[1:], strict=False):  # side by side
            assert left_box.x1 <= right_box.x0, (left.get_title(), left_box, right_box)


def test_every_section_renders_with_a_reason_when_its_records_are_absent(tmp_path):
    train_only = [r for r in synthetic_records() if r["kind"] == "train"]
    for record in train_only:
        for key in ("mfu", "breakdown_s"):
            record.pop(key, None)
    page = write_report(write_run(tmp_path / "a", train_only), tmp_path / "a-out").html_path.read_text()
    assert_every_section(page)
    for reason in ("no cost records: set monitor.usd_per_hour", "no system records", "no MFU in the train records",
                   "no breakdown_s in the train records"):
        assert reason in page, reason

    empty = write_report(write_run(tmp_path / "b", []), tmp_path / "b-out")
    assert_every_section(empty.html_path.read_text())
    assert empty.png_paths == []


def test_cpu_only_system_records_say_no_gpu(tmp_path):
    records = synthetic_records()
    for record in records:
        if record["kind"] == "system":
            record["gpus"] = []
    page = write_report(write_run(tmp_path / "run", records)).html_path.read_text()
    assert "no GPU on this run" in page


def test_diagnosis_is_computed_when_the_run_wrote_none(tmp_path, monkeypatch):
    from skylift.monitor import diagnosis

    records = [r for r in synthetic_records() if r["kind"] != "diagnosis"]
    computed = {"kind": "diagnosis", "step": 80, "bound": "input", "shares": {"data_wait": 0.7}, "findings": []}
    monkeypatch.setattr(diagnosis, "diagnose", lambda rs: computed)
    assert find_diagnosis(records) == (computed, "computed by the report from the records")

    def broken(records):
        raise ValueError("bad records")

    monkeypatch.setattr(diagnosis, "diagnose", broken)
    report = write_report(write_run(tmp_path / "run", records))
    assert report.diagnosis is None and "diagnose() failed with ValueError: bad records" in report.diagnosis_note
    assert "diagnose() failed" in report.html_path.read_text()


# -- attempts ------------------------------------------------------------------------------


def _train(step: int) -> dict:
    return {"kind": "train", "step": step, "time": float(step)}


def test_attempts_split_at_run_start_records():
    records = [{"kind": "run_start", "time": 0.0}, _train(1), _train(2), {"kind": "run_start", "time": 5.0}, _train(3)]
    assert [len(a.records) for a in split_attempts(records)] == [3, 2]


def test_throughput_after_a_no_op_rerun_is_the_last_attempt_that_trained(tmp_path):
    """A finished run started again trains nothing and writes 0 samples/s in its run_end:
    the report shows the throughput of the attempt that trained (attempt 2's 130), says so,
    and does not claim the run ran at 0 samples/s."""
    from skylift.monitor.attempts import run_figures
    from tests.monitor.synthetic import noop_rerun_records

    records = noop_rerun_records()
    for record in records:
        validate_record(record)
    figures = run_figures(split_attempts(records))
    assert (figures.attempts, figures.samples_per_s, figures.samples_per_s_attempt) == (3, 130.0, 2)
    assert figures.outcome == "finished"
    run_dir = write_run(tmp_path / "run", records)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report" / "index.html").read_text()
    assert "<td>throughput</td><td>130 samples/s (attempt 2, the last that trained)</td>" in page


def test_throughput_of_a_run_whose_last_attempt_trained_is_not_marked():
    from skylift.monitor.attempts import run_figures

    figures = run_figures(split_attempts(synthetic_records()))
    assert (figures.samples_per_s, figures.samples_per_s_attempt) == (130.0, None)
