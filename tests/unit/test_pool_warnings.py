"""A placement failure the pool retries every second is logged once, with its repeat count."""

from __future__ import annotations

import logging

import pytest

from raylane.placement import RoleSpec
from raylane.group import Membership

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_same_placement_failure_is_said_once_and_counted_when_it_clears(caplog):
    pool = Membership.__new__(Membership)  # only the warning bookkeeping, no actors (no Ray)
    pool.role, pool._warned = RoleSpec("rollout_worker", {"CPU": 1.0}, min_count=1, max_count=8), None
    caplog.set_level(logging.WARNING, logger="raylane.group.membership")
    for _ in range(16):
        pool._warn_placement("role 'rollout_worker' needs 1 actor(s) of {CPU=1} but only 0 fit.")
    pool._warn_placement(None)
    pool._warn_placement(None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "cannot place more actors yet" in lines[0] and "only 0 fit" in lines[0]
    assert "repeated 15 more time(s); actors placed again" in lines[1]


def test_a_different_failure_is_said_again():
    pool = Membership.__new__(Membership)
    pool.role, pool._warned = RoleSpec("w", {"CPU": 1.0}, min_count=1, max_count=8), None
    pool._warn_placement("a")
    pool._warn_placement("a")
    pool._warn_placement("b")
    assert pool._warned == ("b", 0)
