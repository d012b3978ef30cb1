"""plot_run draws a run's main metric against steps and elapsed time: no Ray."""

from __future__ import annotations

import json
import logging

import pytest

from raylane.plots import plot_filename, plot_run

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_rows(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert height > 0 and width > height  # two panels side by side


def _pngs(run_dir):
    return sorted(p.name for p in run_dir.iterdir() if p.suffix == ".png" or p.name.endswith(".tmp"))


def test_plot_skips_missing_and_non_finite_values(tmp_path):
    run = tmp_path / "run"
    _write_rows(run, [
        {"step": 0, "time": 1000.0, "loss": 2.0},
        {"step": 1, "time": 1001.0, "other": 1.0},  # no loss
        {"step": 2, "time": 1002.0, "loss": float("nan")},  # NaN literal from json
        {"step": 3, "time": 1003.0, "loss": "nan"},  # how RunLog stores NaN
        {"step": 4, "time": 1004.0, "loss": True},  # a bool is not a value
        {"step": 5, "time": 1005.5, "loss": 1.25},
    ])
    (run / "metrics.jsonl").open("a").write('{"step": 6, "ti')  # torn last line of a killed writer
    path = plot_run(run, "loss")
    assert path == run / "loss.png"
    _assert_png(path)
    assert _pngs(run) == ["loss.png"]


def test_single_usable_row_is_enough(tmp_path):
    _write_rows(tmp_path, [{"step": 7, "time": 5.0, "acc": 0.5}])
    _assert_png(plot_run(tmp_path, "acc", title="one point"))


def test_no_metrics_file_returns_none_and_writes_nothing(tmp_path):
    assert plot_run(tmp_path, "loss") is None
    assert list(tmp_path.iterdir()) == []


def test_no_usable_row_returns_none_and_writes_nothing(tmp_path):
    _write_rows(tmp_path, [{"step": 0, "time": 1.0, "loss": "inf"}, {"step": 1, "time": 2.0}, {"step": 2, "time": 3.0, "loss": None}])
    assert plot_run(tmp_path, "loss") is None
    assert _pngs(tmp_path) == []


def test_metric_with_slash_gets_a_safe_filename(tmp_path):
    _write_rows(tmp_path, [{"step": i, "time": 100.0 + i, "eval/return": float(i)} for i in range(3)])
    path = plot_run(tmp_path, "eval/return")
    assert path == tmp_path / "eval_return.png"
    _assert_png(path)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # no eval/ subfolder


@pytest.mark.parametrize("metric, name", [
    ("loss", "loss.png"),
    ("eval/return", "eval_return.png"),
    ("../../escape", "escape.png"),
    ("..", "metric.png"),
    ("a b$c", "a_b_c.png"),
])
def test_plot_filename(metric, name):
    assert plot_filename(metric) == name


def test_odd_data_warns_instead_of_raising(tmp_path, caplog):
    _write_rows(tmp_path, [{"step": 0, "time": 1.0, "loss": 1.0}])
    (tmp_path / "loss.png").mkdir()  # the target is a folder: saving must fail
    with caplog.at_level(logging.WARNING, logger="raylane.plots"):
        assert plot_run(tmp_path, "loss") is None
    assert "could not plot" in caplog.text
    assert not (tmp_path / ".loss.png.tmp").exists()


def test_rows_without_time_still_plot_against_steps(tmp_path):
    _write_rows(tmp_path, [{"step": 0, "loss$x$": 1.0}, {"step": 1, "loss$x$": 0.5}, ["not", "a", "row"]])
    path = plot_run(tmp_path, "loss$x$")  # dollars are drawn literally, not parsed as mathtext
    assert path == tmp_path / "loss_x.png"
    _assert_png(path)
