"""The cluster view: an immutable, self-validating snapshot of the live Ray nodes.

Built from Ray's node table. Each node carries its market (``spot`` or ``on-demand``,
from the ``ray.io/market-type`` label; unlabeled nodes are on-demand) and a relative
speed (the ``raylane.io/speed`` label where the operator set one, else measured once
per node by a short calibration task and cached in Ray's KV store for the cluster's
lifetime).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Mapping

log = logging.getLogger(__name__)

MARKET_LABEL = "ray.io/market-type"
SPEED_LABEL = "raylane.io/speed"
MARKETS = ("spot", "on-demand")
# Rate (matmul iterations per second) of the calibration loop that counts as speed 1.0.
# Chosen near one current x86 server core so that measured speeds and operator labels
# like "1" or "2" land on a similar scale.
REFERENCE_RATE = 25000.0


class ClusterError(ValueError):
    """The cluster snapshot is inconsistent; the message prints the offending numbers."""


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as raylane sees it."""

    node_id: str
    """Ray's hex node id."""
    address: str = "127.0.0.1"
    """The node's IP address."""
    cpus: float = 1.0
    """Logical CPUs Ray schedules on this node."""
    gpus: float = 0.0
    """Logical GPUs."""
    accelerator_type: str | None = None
    """Accelerator type reported by Ray (e.g. ``H100``), if any."""
    memory: float = 0.0
    """Bytes of memory Ray schedules on this node."""
    market: str = "on-demand"
    """``spot`` or ``on-demand``."""
    speed: float = 1.0
    """Relative speed score; 1.0 is the reference core."""
    speed_source: str = "default"
    """``label``, ``measured`` or ``default`` (calibration off or failed)."""
    alive: bool = True
    """False once Ray has marked the node dead."""
    draining: bool = False
    """True while Ray drains the node (a preemption notice or scale-down)."""
    drain_deadline: float | None = None
    """Unix time the node is expected to vanish, when a notice gave one."""
    is_head: bool = False
    """Whether this is the head node."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """All node labels."""
    available: Mapping[str, float] = field(default_factory=dict)
    """Resources free at snapshot time (``CPU``, ``GPU``, ``memory``, custom)."""

    @property
    def usable(self) -> bool:
        return self.alive and not self.draining


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot of the cluster's nodes. Validates itself at construction."""

    nodes: tuple[NodeInfo, ...]
    taken_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ClusterError(f"duplicate node ids in cluster view: {ids}")
        for n in self.nodes:
            problems = []
            if n.market not in MARKETS:
                problems.append(f"market={n.market!r} (expected one of {MARKETS})")
            if not all(math.isfinite(v) and v >= 0 for v in (n.cpus, n.gpus, n.memory)):
                problems.append(f"cpus={n.cpus}, gpus={n.gpus}, memory={n.memory} (must be >= 0)")
            if not (math.isfinite(n.speed) and n.speed > 0):
                problems.append(f"speed={n.speed} (must be a finite number > 0; fix the {SPEED_LABEL} label)")
            if problems:
                raise ClusterError(f"node {n.node_id}: " + "; ".join(problems))

    @property
    def alive(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.alive)

    @property
    def usable(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.usable)

    def node(self, node_id: str) -> NodeInfo:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id} in the cluster view; nodes: {[n.node_id[:8] for n in self.nodes]}")

    def by_market(self, market: str) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.usable if n.market == market)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {"nodes": 0, "CPU": 0.0, "GPU": 0.0}
        for n in self.alive:
            out["nodes"] += 1
            out["CPU"] += n.cpus
            out["GPU"] += n.gpus
        return out

    def to_json(self) -> dict:
        return {
            "taken_at": self.taken_at,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "address": n.address,
                    "cpus": n.cpus,
                    "gpus": n.gpus,
                    "accelerator_type": n.accelerator_type,
                    "memory": n.memory,
                    "market": n.market,
                    "speed": n.speed,
                    "speed_source": n.speed_source,
                    "alive": n.alive,
                    "draining": n.draining,
                    "drain_deadline": n.drain_deadline,
                    "is_head": n.is_head,
                    "labels": dict(n.labels),
                    "available": dict(n.available),
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_ray(cls, *, calibrate: bool = True, include_dead: bool = False, calibration_timeout_s: float = 30.0) -> "ClusterView":
        """Snapshot the cluster Ray is connected to (``ray.init`` must have run)."""
        from raylane import raystate

        infos = []
        raws = raystate.nodes()
        # Speed is relative: on a one-node cluster there is nothing to compare, so the
        # calibration task (a worker process start, ~1 s) is skipped.
        calibrate = calibrate and sum(1 for r in raws if r.alive) > 1
        for raw in raws:
            if not raw.alive and not include_dead:
                continue
            market = raw.labels.get(MARKET_LABEL, "on-demand")
            speed, source = _label_speed(raw.node_id, raw.labels)
            if speed is None:
                cached = raystate.kv_get(f"speed:{raw.node_id}")
                if cached is not None:
                    speed, source = float(cached), "measured"
                elif calibrate and raw.alive and not raw.draining:
                    speed, source = node_speed(raw.node_id, timeout_s=calibration_timeout_s)
                else:
                    speed, source = 1.0, "default"
            accel = next((k.split(":", 1)[1] for k in raw.total if k.startswith("accelerator_type:")), None)
            record = raystate.drain_record(raw.node_id) if raw.draining else None
            infos.append(
                NodeInfo(
                    node_id=raw.node_id,
                    address=raw.address,
                    cpus=raw.total.get("CPU", 0.0),
                    gpus=raw.total.get("GPU", 0.0),
                    accelerator_type=accel,
                    memory=raw.total.get("memory", 0.0),
                    market=market,
                    speed=speed,
                    speed_source=source,
                    alive=raw.alive,
                    draining=raw.draining,
                    drain_deadline=(record or {}).get("deadline"),
                    is_head=raw.is_head,
                    labels=raw.labels,
                    available={k: v for k, v in raw.available.items() if not k.startswith("node:")},
                )
            )
        return cls(tuple(infos))


def _label_speed(node_id: str, labels: Mapping[str, str]) -> tuple[float | None, str]:
    text = labels.get(SPEED_LABEL)
    if text is None:
        return None, "default"
    try:
        value = float(text)
    except ValueError:
        raise ClusterError(f"node {node_id}: label {SPEED_LABEL}={text!r} is not a number; set it to a relative speed such as 1 or 2.5") from None
    return value, "label"


def _calibration_loop(seconds: float = 0.2) -> float:
    """Matmul iterations per second on one thread: a crude but stable compute score."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(128, 128)
    b = torch.randn(128, 128)
    for _ in range(20):  # warm-up
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ b
        n += 20
    return n / (time.perf_counter() - start)


def node_speed(node_id: str, *, timeout_s: float = 30.0) -> tuple[float, str]:
    """The node's measured speed, from the KV cache or a calibration task pinned to it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raylane import raystate

    cached = raystate.kv_get(f"speed:{node_id}")
    if cached is not None:
        return float(cached), "measured"
    task = ray.remote(num_cpus=0, max_retries=0)(_calibration_loop).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )
    ref = task.remote()
    try:
        rate = ray.get(ref, timeout=timeout_s)
    except Exception as exc:  # a slow or dying node must not block the snapshot
        ray.cancel(ref, force=True)
        log.warning("speed calibration on node %s failed (%s); using speed 1.0", node_id[:8], exc)
        return 1.0, "default"
    speed = round(max(rate / REFERENCE_RATE, 1e-3), 3)
    raystate.kv_put(f"speed:{node_id}", speed)
    return speed, "measured"
