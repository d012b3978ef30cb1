"""The pool autoscaling policy and the scale-request checks, without Ray."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.control import ControlError, check_scale
from raylane.driver import DriverConfig
from raylane.policies import Autoscaler, PoolAutoscale

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def run_script(scaler: Autoscaler, role: str, target: int, script: list[tuple[float, float, float]]) -> list[tuple[float, int, str]]:
    """Feed (time, waited, busy) observations step by step; apply every decision."""
    changes = []
    for now, waited, busy in script:
        scaler.observe(role, waited, busy)
        decision = scaler.decide(role, target, now=now)
        if decision is not None:
            target, reason = decision
            changes.append((now, target, reason))
    return changes


def test_a_starved_pool_grows_one_at_a_time_with_a_cooldown_then_an_idle_one_shrinks():
    scaler = Autoscaler([PoolAutoscale("rollout_worker", min=1, max=3, window_steps=3, cooldown_s=10)])
    starved = [(t, 0.6, 1.0) for t in range(0, 40, 2)]  # the learner waits 60% of every step
    idle = [(t, 0.0, 0.1) for t in range(40, 100, 2)]  # later: nobody waits, actors mostly idle
    changes = run_script(scaler, "rollout_worker", 1, starved + idle)
    targets = [t for _, t, _ in changes]
    assert targets == [2, 3, 2, 1], changes  # up to max, then down to min, one step each
    times = [now for now, _, _ in changes]
    assert times[0] == 4  # after a full window of 3 observations
    assert all(b - a >= 10 for a, b in zip(times, times[1:]))  # the cooldown holds
    assert "waited 60%" in changes[0][2] and "busy 10%" in changes[2][2]


def test_a_busy_pool_whose_consumer_does_not_wait_is_left_alone():
    scaler = Autoscaler([PoolAutoscale("s", min=1, max=4, cooldown_s=0)])
    changes = run_script(scaler, "s", 2, [(t, 0.05, 0.9) for t in range(20)])
    assert changes == []


def test_alternating_signals_do_not_flap():
    scaler = Autoscaler([PoolAutoscale("s", min=1, max=4, window_steps=4, cooldown_s=30)])
    script = [(t, 0.5 if t % 2 else 0.0, 0.2) for t in range(60)]  # noisy: averages 25% waiting
    changes = run_script(scaler, "s", 2, script)
    assert len(changes) <= 2, changes  # at most one change per cooldown


def test_no_growth_without_room_and_targets_outside_the_range_are_clamped():
    scaler = Autoscaler([PoolAutoscale("s", min=2, max=3, window_steps=1, cooldown_s=0)])
    scaler.observe("s", 1.0, 1.0)
    assert scaler.decide("s", 2, now=0.0, can_grow=False) is None
    assert scaler.decide("s", 7, now=1.0)[0] == 3
    assert scaler.decide("other", 2, now=2.0) is None  # not opted in


def test_autoscale_specs_load_from_config_and_bad_ones_are_refused():
    conf = cfg.load_config(DriverConfig, overrides=["pool_autoscale=[{role: rollout_worker, min: 1, max: 6}]"])
    assert conf.pool_autoscale[0].role == "rollout_worker" and conf.pool_autoscale[0].max == 6
    with pytest.raises(cfg.ConfigError, match=r"max=1 is below min=2"):
        cfg.load_config(DriverConfig, overrides=["pool_autoscale=[{role: x, min: 2, max: 1}]"])
    with pytest.raises(cfg.ConfigError, match=r"min=0"):
        cfg.load_config(DriverConfig, overrides=["pool_autoscale=[{role: x, min: 0}]"])


POOLS = {"rollout_worker": {"lo": 1, "hi": 16}, "learner": {"lo": 1, "hi": 1}}


@pytest.mark.parametrize(
    "role, n, message",
    [
        ("sampler", 2, r"unknown role 'sampler'; this run's pools are: learner, rollout_worker"),
        ("learner", 2, r"role 'learner' has a fixed size of 1"),
        ("rollout_worker", 0, r"0 actors for role 'rollout_worker' is outside its range 1\.\.16"),
        ("rollout_worker", 17, r"17 actors .* outside its range 1\.\.16"),
    ],
)
def test_bad_scale_requests_say_what_is_valid(role, n, message):
    with pytest.raises(ControlError, match=message):
        check_scale(POOLS, role, n)
    check_scale(POOLS, "rollout_worker", 16)  # the edges are fine
