"""The progress bar counts toward the rule that will stop the run, at this invocation's rate."""

from __future__ import annotations

import pytest

from raylane.runlog import Progress

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_bar_follows_the_stop_rule_furthest_along():
    # PPO's defaults: max_steps=1,000,000 iterations, total_env_steps=500,000 (512 a step)
    ppo = [(165.0, 1_000_000.0, "steps"), (165 * 512.0, 500_000.0, "env steps")]
    assert Progress.pick(ppo) == (165 * 512.0, 500_000.0, "env steps")
    # the same job with --set driver.max_steps=5: the step budget ends it first
    short = [(2.0, 5.0, "steps"), (1024.0, 500_000.0, "env steps")]
    assert Progress.pick(short) == (2.0, 5.0, "steps")
    # a wall-clock limit about to run out wins over both
    assert Progress.pick([*short, (59.0, 60.0, "s")]) == (59.0, 60.0, "s")
    assert Progress.pick([(3.0, 0.0, "steps")]) is None  # no total: nothing to count toward


def test_the_rate_counts_from_this_invocation_not_from_step_zero():
    bar = Progress(False, ("loss",), "ppo")
    # a run resumed at step 576036 (a checkpoint): the first step after it is one step, not 576037
    bar._first["steps"] = (576_036.0, 100.0)
    assert bar.rate(576_037.0, "steps", now=100.5) == pytest.approx(2.0)
    # a unit first seen now has no rate until it moves
    assert bar.rate(1_000.0, "env steps", now=200.0) is None
    assert bar.rate(3_000.0, "env steps", now=204.0) == pytest.approx(500.0)


def test_a_disabled_bar_takes_updates_silently(capfd):
    bar = Progress(False, ("loss",), "linreg")
    bar.begin(0)
    bar.update(1, {"loss": 0.5}, [(1.0, 10.0, "steps"), (64.0, 640.0, "env steps")])
    bar.log("a line the bar would print")
    bar.close()
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)  # nothing on the terminal, not even the log line
    assert bar._p is None  # no rich display was made
    assert set(bar._first) == {"steps"}  # begin() still counts; an ignored update records no measure
    # the same calls on an enabled bar do print: the capture above would have seen them
    shown = Progress(True, ("loss",), "linreg")
    shown.begin(0)
    shown.update(1, {"loss": 0.5}, [(1.0, 10.0, "steps")])
    shown.log("a line the bar would print")
    shown.close()
    out, err = capfd.readouterr()
    assert "a line the bar would print" in out + err
