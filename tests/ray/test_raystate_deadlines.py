"""The control plane's key-value calls end at their deadline when the GCS stops answering."""

from __future__ import annotations

import signal

import pytest
import ray

from raylane import raystate

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def test_kv_round_trip_in_raylanes_namespace(ray_local):
    raystate.kv_put("t:a", {"v": [1, 2]})
    assert raystate.kv_get("t:a") == {"v": [1, 2]}
    assert raystate.kv_keys("t:") == ["t:a"] and raystate.kv_get("t:missing") is None
    raystate.kv_del("t:a")
    assert raystate.kv_keys("t:") == []


def test_a_frozen_gcs_costs_an_error_at_the_deadline_not_a_hang(ray_local):
    from ray._private import worker

    gcs = worker._global_node.all_processes["gcs_server"][0].process
    gcs.send_signal(signal.SIGSTOP)  # answers nothing, closes nothing: the worst case for a caller
    try:
        for call in (lambda: raystate.kv_get("t:a", timeout_s=1), lambda: raystate.kv_put("t:a", 1, timeout_s=1),
                     lambda: raystate.kv_keys("t:", timeout_s=1), lambda: raystate.kv_del("t:a", timeout_s=1)):
            with pytest.raises(ray.exceptions.RpcError, match="Deadline"):
                call()
    finally:
        gcs.send_signal(signal.SIGCONT)
    raystate.kv_put("t:b", 2)  # and the GCS serves again once it is back
    assert raystate.kv_get("t:b") == 2
