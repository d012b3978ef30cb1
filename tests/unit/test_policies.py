"""raylane.policies (FailurePolicy, group_errors, ScalingPolicy) and raylane.checkpoint_cadence's CheckpointPolicy (pure, no Ray)."""

from __future__ import annotations

import pytest

from raylane.checkpoint_cadence import CheckpointPolicy, CheckpointStatus
from raylane.policies import (
    Decision,
    Failure,
    FailurePolicy,
    PoolView,
    ScalingPolicy,
    group_errors,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def fail(role="worker", actor="#0", message="boom", step=1) -> Failure:
    return Failure(role=role, actor=actor, message=message, step=step, at=0.0)


# --------------------------------------------------------------------------- group_errors


def test_group_errors_docstring_example():
    out = group_errors([Failure("w", "#1", "boom", 3, 0.0), Failure("w", "#2", "boom", 3, 0.0)])
    assert out == "2x from w #1, w #2:\n  boom"


def test_group_errors_groups_identical_messages_in_first_seen_order():
    failures = [
        fail("worker", "#1", "CUDA OOM\n  at step 7"),
        fail("learner", "#0", "NaN loss"),
        fail("worker", "#3", "  CUDA OOM\n  at step 7\n"),  # same after strip()
        fail("sampler", "#2", "NaN loss"),
    ]
    assert group_errors(failures) == (
        "2x from worker #1, worker #3:\n"
        "  CUDA OOM\n"
        "    at step 7\n"
        "2x from learner #0, sampler #2:\n"
        "  NaN loss"
    )


def test_group_errors_keeps_at_most_30_lines_per_message():
    message = "\n".join(f"line {i}" for i in range(40))
    out = group_errors([fail(message=message)])
    lines = out.splitlines()
    assert lines[0] == "1x from worker #0:"
    assert len(lines) == 31
    assert lines[-1] == "  line 29"
    assert "line 30" not in out


def test_group_errors_empty():
    assert group_errors([]) == ""


# --------------------------------------------------------------------------- FailurePolicy


def test_failure_policy_recovers_until_budget_then_fails():
    policy = FailurePolicy(max_failures=3)
    assert policy.decide([]) == Decision("recover", "no failures")
    failures = [fail(actor=f"#{i}", message=f"err {i % 2}") for i in range(4)]
    for n in (1, 2, 3):
        d = policy.decide(failures[:n])
        assert d == Decision("recover", f"failure {n} of at most 3")
    d = policy.decide(failures)
    assert d.action == "fail"
    assert d.reason.startswith("4 failures exceed max_failures=3:\n")
    assert "2x from worker #0, worker #2:\n  err 0" in d.reason
    assert "2x from worker #1, worker #3:\n  err 1" in d.reason


def test_failure_policy_zero_budget_fails_first_failure():
    d = FailurePolicy(max_failures=0).decide([fail(message="x")])
    assert d.action == "fail"
    assert "1 failures exceed max_failures=0" in d.reason


def test_failure_policy_per_role_budget():
    policy = FailurePolicy(max_failures=10, per_role={"learner": 1})
    one = [fail("learner", "#0", "diverged"), fail("worker", "#1", "env crash"), fail("worker", "#2", "env crash")]
    assert policy.decide(one).action == "recover"
    two = one + [fail("learner", "#0", "diverged again")]
    d = policy.decide(two)
    assert d.action == "fail"
    assert d.reason == (
        "role 'learner' failed 2 times, budget 1:\n"
        "1x from learner #0:\n  diverged\n"
        "1x from learner #0:\n  diverged again"
    )
    assert "env crash" not in d.reason


def test_failure_policy_total_budget_checked_before_role_budget():
    policy = FailurePolicy(max_failures=1, per_role={"learner": 0})
    d = policy.decide([fail("learner"), fail("learner")])
    assert d.reason.startswith("2 failures exceed max_failures=1")


def test_failure_policy_not_recoverable_fails_at_once():
    policy = FailurePolicy(max_failures=5)
    d = policy.decide([fail(message="ok"), fail(message="checkpoint corrupt\ntraceback...")], recoverable=False)
    assert d == Decision("fail", "not recoverable: checkpoint corrupt")
    d = policy.decide([fail(message="")], recoverable=False)
    assert d == Decision("fail", "not recoverable: ?")
    grouped = "2 call(s) of 'train' on shard 1, shard 0 raised:\nCheck failed: max_bin (256 vs. 64)\n  more"
    d = policy.decide([fail(message=grouped)], recoverable=False)  # the header alone would say nothing
    assert d == Decision("fail", "not recoverable: 2 call(s) of 'train' on shard 1, shard 0 raised: Check failed: max_bin (256 vs. 64)")


@pytest.mark.parametrize("kwargs, fragment", [(dict(max_failures=-1), "got -1"), (dict(per_role={"learner": -2}), "per_role['learner'] must be >= 0, got -2")])
def test_failure_policy_validation(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        FailurePolicy(**kwargs)
    assert fragment in str(e.value)


# --------------------------------------------------------------------------- CheckpointPolicy


def status(step, last_step=None, last_time=0.0, now=0.0, **kw) -> CheckpointStatus:
    return CheckpointStatus(step=step, last_step=last_step, last_time=last_time, now=now, **kw)


def test_checkpoint_every_n_steps():
    policy = CheckpointPolicy(every_steps=10)
    saves = [s for s in range(1, 36) if policy.decide(status(s, last_step=0))[0]]
    assert saves == [10, 20, 30]
    assert policy.decide(status(20, last_step=10)) == (True, "every 10 steps")
    assert policy.decide(status(21, last_step=20)) == (False, "")


def test_checkpoint_every_t_seconds():
    policy = CheckpointPolicy(every_steps=0, every_s=60.0)
    assert policy.decide(status(5, last_step=1, last_time=100.0, now=159.0)) == (False, "")
    assert policy.decide(status(5, last_step=1, last_time=100.0, now=160.0)) == (True, "60 s since the last checkpoint")
    assert policy.decide(status(5, last_step=1, last_time=100.0, now=230.4)) == (True, "130 s since the last checkpoint")
    # every_steps=0 turns the step rule off
    assert policy.decide(status(10, last_step=1, last_time=100.0, now=101.0)) == (False, "")


def test_checkpoint_notice_saves_at_once():
    policy = CheckpointPolicy(every_steps=100, every_s=3600.0)
    assert policy.decide(status(7, last_step=0, notice=True)) == (True, "preemption notice for a node with stateful actors")
    assert policy.decide(status(7, last_step=0)) == (False, "")


def test_checkpoint_final():
    policy = CheckpointPolicy(every_steps=100)
    assert policy.decide(status(57, last_step=50, final=True)) == (True, "run finished")


def test_checkpoint_no_double_save_at_same_step():
    policy = CheckpointPolicy(every_steps=10, every_s=1.0)
    for kw in (dict(), dict(notice=True), dict(final=True), dict(notice=True, final=True)):
        assert policy.decide(status(10, last_step=10, last_time=0.0, now=1e6, **kw)) == (False, "already saved at this step")


def test_checkpoint_everything_off_only_notice_and_final():
    policy = CheckpointPolicy(every_steps=0, every_s=0.0)
    assert not any(policy.decide(status(s, last_step=0, now=1e9))[0] for s in range(1, 50))
    assert policy.decide(status(3, last_step=0, final=True))[0] is True
    assert policy.decide(status(3, last_step=0, notice=True))[0] is True


@pytest.mark.parametrize("kwargs, fragment", [(dict(every_steps=-1), "got -1, 0.0"), (dict(every_s=-5.0), "got 10, -5.0")])
def test_checkpoint_validation(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        CheckpointPolicy(**kwargs)
    assert fragment in str(e.value)


# --------------------------------------------------------------------------- ScalingPolicy


def pool(role="worker", wanted=4, target=4, live=4, lo=2, hi=8, fits_more=0) -> PoolView:
    return PoolView(role=role, wanted=wanted, target=target, live=live, lo=lo, hi=hi, fits_more=fits_more)


def test_scaling_grows_back_toward_the_wanted_size_when_capacity_appears():
    policy = ScalingPolicy()
    assert policy.targets([pool(wanted=6, target=3, live=3, fits_more=2)]) == {"worker": 5}
    assert policy.targets([pool(wanted=6, target=3, live=3, fits_more=10)]) == {"worker": 6}
    assert policy.targets([pool(wanted=6, target=6, live=6, fits_more=10)]) == {}  # never past wanted
    assert policy.targets([pool(wanted=20, target=7, live=7, fits_more=10)]) == {"worker": 8}  # nor past hi
    assert ScalingPolicy(grow=False).targets([pool(wanted=6, target=3, live=3, fits_more=2)]) == {}


def test_scaling_shrinks_to_what_survives_when_nothing_fits_never_below_lo():
    policy = ScalingPolicy()
    assert policy.targets([pool(wanted=6, target=6, live=4, lo=2, fits_more=0)]) == {"worker": 4}
    assert policy.targets([pool(wanted=6, target=6, live=1, lo=2, fits_more=0)]) == {"worker": 2}
    assert policy.targets([pool(wanted=6, target=6, live=4, lo=2, fits_more=1)]) == {}  # the pool refills itself
    assert policy.targets([pool(wanted=4, target=4, live=4)]) == {}


def test_scaling_leaves_fixed_size_roles_alone():
    policy = ScalingPolicy()
    pools = [pool("shard", wanted=4, target=4, live=2, lo=4, hi=4, fits_more=0), pool("worker", wanted=5, target=3, live=3, lo=1, hi=6, fits_more=1)]
    assert policy.targets(pools) == {"worker": 4}


def test_a_recovery_that_outlasts_max_recovery_s_fails_the_run_naming_the_limit():
    policy = FailurePolicy(max_failures=100, max_recovery_s=60)
    first = Failure("worker", "#0", "actor died", 7, at=1000.0)
    assert policy.decide([first]).action == "recover"  # the failure that starts the recovery
    again = Failure("worker", "#1", "no room for 2 workers", 7, at=1030.0)
    assert policy.decide([first, again], recovering_since=1000.0).action == "recover"
    late = Failure("worker", "#1", "no room for 2 workers", 7, at=1061.0)
    decision = policy.decide([first, again, late], recovering_since=1000.0)
    assert decision.action == "fail"
    assert "max_recovery_s=60" in decision.reason and "61 s since the failure at step 7" in decision.reason
    assert "no room for 2 workers" in decision.reason
    unbounded = FailurePolicy(max_failures=100, max_recovery_s=0)
    assert unbounded.decide([first, again, late], recovering_since=1000.0).action == "recover"


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_max_recovery_s_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="max_recovery_s"):
        FailurePolicy(max_recovery_s=bad)


def test_non_finite_names_the_first_guarded_metric_that_is_nan_or_infinite():
    import numpy as np
    import torch

    from raylane.policies import non_finite

    assert non_finite({"loss": 0.5, "lr": float("nan")}, ["loss"]) is None  # only guarded metrics count
    key, value = non_finite({"loss": np.float32("nan")}, ["loss"])
    assert key == "loss" and value != value
    assert non_finite({"a": 1.0, "b": torch.tensor(float("inf"))}, ["a", "b"]) == ("b", float("inf"))
    assert non_finite({"loss": "n/a", "other": None}, ["loss", "other", "absent"]) is None  # not numbers: not judged
