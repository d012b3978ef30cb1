"""Everything raylane reads from or asks of Ray's control plane, in one module.

Some of what the platform needs has no stable public API in Ray 2.60: a node's
draining status lives in the autoscaler's resource state, and draining a node is a
GCS client call. Keeping those calls here means a Ray upgrade touches one file.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import ray

KV_NAMESPACE = "raylane"


@dataclass(frozen=True)
class RawNode:
    """One row of Ray's node table merged with the autoscaler's view of it."""

    node_id: str
    address: str
    alive: bool
    draining: bool
    is_head: bool
    labels: dict[str, str]
    total: dict[str, float]
    available: dict[str, float]


def _gcs_client():
    return ray._private.worker.global_worker.gcs_client


def gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


def nodes() -> list[RawNode]:
    """Every node Ray knows (alive and dead), with draining status and free resources."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state
    from ray.core.generated import autoscaler_pb2

    state = {}
    try:
        resource_state = get_cluster_resource_state(_gcs_client())
        for ns in resource_state.node_states:
            state[ns.node_id.hex()] = ns
    except Exception:  # the autoscaler state is an optimisation; the node table is the truth
        state = {}
    out = []
    for n in ray.nodes():
        nid = n["NodeID"]
        ns = state.get(nid)
        draining = bool(ns is not None and ns.status == autoscaler_pb2.NodeStatus.DRAINING)
        total = {k: float(v) for k, v in n.get("Resources", {}).items()}
        if ns is not None and n["Alive"]:
            available = {k: float(v) for k, v in ns.available_resources.items()}
        else:
            available = dict(total) if n["Alive"] else {}
        out.append(
            RawNode(
                node_id=nid,
                address=n.get("NodeManagerAddress", ""),
                alive=bool(n["Alive"]),
                draining=draining,
                is_head="node:__internal_head__" in total,
                labels=dict(n.get("Labels", {})),
                total=total,
                available=available,
            )
        )
    return out


# The control channel calls these every step: each has a deadline, so a GCS that stopped
# answering (restarting, or stopped under an embedded run) costs a warning, not a hang.
KV_TIMEOUT_S = 5.0


def _kv():
    """The GCS client when this process is a Ray driver or worker; None under Ray Client
    (``ray://``), whose KV calls go through the client's own channel and its deadlines."""
    from ray.experimental import internal_kv

    return internal_kv.global_gcs_client


def kv_get(key: str, timeout_s: float = KV_TIMEOUT_S) -> Any | None:
    from ray.experimental import internal_kv

    gcs = _kv()
    raw = (internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) if gcs is None
           else gcs.internal_kv_get(key.encode(), KV_NAMESPACE.encode(), timeout=timeout_s))
    return None if raw is None else json.loads(raw)


def kv_put(key: str, value: Any, timeout_s: float = KV_TIMEOUT_S) -> None:
    from ray.experimental import internal_kv

    gcs, raw = _kv(), json.dumps(value)
    if gcs is None:
        internal_kv._internal_kv_put(key, raw, overwrite=True, namespace=KV_NAMESPACE)
    else:
        gcs.internal_kv_put(key.encode(), raw.encode(), True, KV_NAMESPACE.encode(), timeout=timeout_s)


def kv_del(key: str, timeout_s: float = KV_TIMEOUT_S) -> None:
    from ray.experimental import internal_kv

    gcs = _kv()
    if gcs is None:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    else:
        gcs.internal_kv_del(key.encode(), False, KV_NAMESPACE.encode(), timeout=timeout_s)


def kv_keys(prefix: str, timeout_s: float = KV_TIMEOUT_S) -> list[str]:
    """Keys in raylane's namespace that start with ``prefix``."""
    from ray.experimental import internal_kv

    gcs = _kv()
    keys = (internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE) if gcs is None
            else gcs.internal_kv_keys(prefix.encode(), KV_NAMESPACE.encode(), timeout=timeout_s))
    return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)


def autoscaler_present() -> bool:
    """Whether an autoscaler reports to this cluster (the v2 autoscaler's state version).
    A local Ray or a hand-started ``ray start`` cluster has none. The v1 autoscaler
    leaves no record that tells "may launch nodes" from "only watches", so it counts as
    absent: raylane still sends it the request, and only the message is more cautious."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    try:
        return get_cluster_resource_state(_gcs_client()).last_seen_autoscaler_state_version > 0
    except Exception:  # an older GCS without the v2 state
        return False


def requested_resources() -> list[dict[str, float]]:
    """The standing request to the autoscaler (what :func:`request_resources` last asked)."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state
    from ray.experimental import internal_kv

    try:
        constraints = get_cluster_resource_state(_gcs_client()).cluster_resource_constraints
        bundles = [dict(b.resources_bundle) for c in constraints for r in c.resource_requests for b in [r.request] * r.count]
        if bundles:
            return bundles
    except Exception:  # older GCS; fall back to the v1 record
        pass
    raw = internal_kv._internal_kv_get("autoscaler_resource_request")
    return json.loads(raw) if raw else []


def request_resources(bundles: list[dict[str, float]], selectors: list[dict[str, str]]) -> None:
    """Ask the autoscaler for room for ``bundles`` (replaces the previous request)."""
    from ray.autoscaler.sdk import request_resources as _request

    _request(bundles=bundles, bundle_label_selectors=selectors)


def drain_node(node_id: str, deadline_s: float | None, reason: str = "preemption", message: str = "") -> None:
    """Ask Ray to drain ``node_id``: no new work is scheduled there.

    ``deadline_s`` is how long until the node goes away. Ray itself keeps no readable
    record of the deadline, so it is also written to the KV store where the preemption
    monitor reads it. Raises RuntimeError if Ray rejects the request.
    """
    from ray.core.generated import autoscaler_pb2

    reasons = {
        "preemption": "DRAIN_NODE_REASON_PREEMPTION",
        "idle": "DRAIN_NODE_REASON_IDLE_TERMINATION",
    }
    if reason not in reasons:
        raise ValueError(f"drain reason must be one of {sorted(reasons)}, got {reason!r}")
    deadline_at = None if deadline_s is None else time.time() + deadline_s
    kv_put(f"drain:{node_id}", {"deadline": deadline_at, "reason": reason, "message": message})
    deadline_ms = 0 if deadline_at is None else int(deadline_at * 1000)
    accepted, why = _gcs_client().drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(reasons[reason]), message or reason, deadline_ms
    )
    if not accepted:
        raise RuntimeError(f"Ray rejected draining node {node_id}: {why}")


def drain_record(node_id: str) -> dict | None:
    return kv_get(f"drain:{node_id}")


def prefer_token_auth() -> bool:
    """Before joining a cluster: with ``RAY_AUTH_MODE`` unset and a token at hand (the
    variable, the file it names, or ``~/.ray/auth_token``), send it. Ray does this by
    itself only for ``address="auto"``; given an explicit address it joins without the
    token, and a token cluster then refuses it without saying why. True when token mode is on."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    try:
        return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))
    except Exception:  # noqa: BLE001 - an older Ray without it: the join error names the token instead
        return False
