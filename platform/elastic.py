"""Pool sizes between steps: growing and shrinking elastic pools with the cluster's
capacity, the opt-in utilisation autoscaler, requests to Ray's autoscaler for missing
room, and the control channel behind ``raylane pools`` and ``raylane scale``.

The driver calls :meth:`Elasticity.settle` and :meth:`Elasticity.control` between steps;
nothing here fails a run except a pool that fails while resizing (recovery's business).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from raylane.cluster import MARKET_LABEL, ClusterView
from raylane.placement import capacity, fmt_res, shortfalls
from raylane.policies import Autoscaler, PoolAutoscale, PoolView, ScalingPolicy
from raylane.group import Membership, PoolError
from raylane.runlog import say

log = logging.getLogger(__name__)


class Elasticity:
    """The sizes of one run's pools. ``wanted`` is each pool's size as asked (by the
    config, ``raylane scale`` or the autoscaler), which may exceed what is live now."""

    def __init__(self, workload: Any, *, autoscale: bool, pool_autoscale: list[PoolAutoscale], scaling_policy: ScalingPolicy,
                 cluster_source: Callable[[], ClusterView], run_name: str):
        self.workload = workload
        self.autoscale = autoscale
        self.scaling_policy = scaling_policy
        self._cluster_source = cluster_source
        self.run_name = run_name
        self.ctx: Any = None
        self.wanted: dict[str, int] = {}
        self._autoscaler = Autoscaler(pool_autoscale)
        self._busy_seen: dict[str, tuple[float, float]] = {}
        self._channel: Any = None
        self._requested: list | None = None
        self._has_autoscaler: bool | None = None
        self._step = 0

    def report_shortfalls(self, roles: list, the_plan: Any, runlog: Any) -> list[dict]:
        """Roles the cluster cannot hold in full now: an event and a line each. The run goes
        on with what fits; the asked size stands (see :meth:`keep_asks`)."""
        short = shortfalls(roles, the_plan)
        for s in short:
            runlog.event("shortfall", **s)
            say(f"{s['role']}: asked for {s['asked']}, the cluster holds {s['got']} now; missing {fmt_res(s['missing'])}. "
                f"Running with {s['got']}; " + (f"the pool grows toward {s['asked']} as room appears." if self.autoscale
                                                 else "driver.autoscale is off: `raylane scale` grows it."))
        return short

    def _pools(self) -> dict[str, Membership]:
        """The run's groups (the driver's registry), once the run has its context."""
        return {} if self.ctx is None else self.ctx.groups.all()

    def keep_asks(self, short: list[dict]) -> None:
        """The asked sizes of the short roles stand: their pools grow back when nodes with room join."""
        pools = self._pools()
        for s in short:
            if s["role"] in pools:
                self.wanted[s["role"]] = s["asked"]

    def start(self, ctx: Any, step: int, *, control: bool) -> None:
        """Take the run's context; with ``control``, open the channel ``raylane pools`` reads."""
        self.ctx, self._step = ctx, step
        if not control:
            return
        import ray

        if ray.is_initialized():
            from raylane.control import ControlChannel

            self._channel = ControlChannel(self.run_name, self.workload.name)
            self._quietly(self._channel.register)
            self._quietly(self._channel.publish, step, self._reports(self._pools()))

    def close(self, state: str) -> None:
        if self._channel is not None:
            self._quietly(self._channel.close, state)

    def settle(self) -> None:
        """Between steps: a pool that cannot refill (or has room to grow back) is rescaled."""
        if self.ctx is None or not self.autoscale:
            return
        pools = self._pools()
        for name, pool in pools.items():
            self.wanted.setdefault(name, pool.target)
        if any(p.size < p.target or p.target < self.wanted[n] for n, p in pools.items() if p.role.lo != p.role.hi):
            self.ctx.cluster = self._cluster_source()
            self.rescale(pools)

    def rescale(self, pools: dict[str, Membership]) -> None:
        assert self.ctx is not None
        views = []
        for name, pool in pools.items():
            self.wanted.setdefault(name, pool.target)
            views.append(PoolView(name, self.wanted[name], pool.target, pool.size, pool.role.lo, pool.role.hi, capacity(pool.role, self.ctx.cluster)))
        for role, target in self.scaling_policy.targets(views).items():
            self.ctx.log.event("scale", role=role, target=target, wanted=self.wanted[role], reason="capacity changed")
            pools[role].resize(target)

    @staticmethod
    def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The control channel is a convenience: its failures never fail the run."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.warning("control channel: %s", exc)
            return None

    def control(self, step: int) -> None:
        """Between steps: autoscaling decisions, then requests from ``raylane scale``,
        then the pools' report for ``raylane pools``."""
        if self.ctx is None:
            return
        self._step = step
        pools = self._pools()
        if self._autoscaler.specs:
            self._autoscale(pools)
        if self._requested or any(self.wanted.get(r, p.target) > p.size for r, p in pools.items()):
            self._request_capacity(pools)  # keep the standing request to the autoscaler current
        if self._channel is not None:
            for req in self._quietly(self._channel.requests) or []:
                try:
                    self._handle_request(req, pools)
                except PoolError:
                    raise  # a pool that fails while resizing is the run's business (recovery)
                except Exception as exc:  # noqa: BLE001 - a bad request must not end the run
                    log.exception("control request %s failed", req)
                    self._quietly(self._channel.respond, req, False, f"the driver could not serve the request: {type(exc).__name__}: {exc}")
            self._quietly(self._channel.publish, self._step, self._reports(pools))

    def pool_sizes(self) -> dict[str, int]:
        """Elastic pools' target and live size, logged with every step's metrics (so scaling
        decisions show in metrics.jsonl and TensorBoard next to what they did)."""
        out = {}
        for role, pool in self._pools().items():
            if pool.role.lo != pool.role.hi:
                out[f"pool/{role}/target"] = pool.target
                out[f"pool/{role}/live"] = pool.size
        return out

    def _autoscale(self, pools: dict[str, Membership]) -> None:
        assert self.ctx is not None
        waited = self.workload.waits()
        now = time.time()
        for role, spec in self._autoscaler.specs.items():
            pool = pools.get(role)
            if pool is None:
                continue
            st = pool.status()
            busy_prev, alive_prev = self._busy_seen.get(role, (0.0, 0.0))
            self._busy_seen[role] = (st.busy_s, st.alive_s)
            d_alive = st.alive_s - alive_prev
            busy = (st.busy_s - busy_prev) / d_alive if d_alive > 0 and st.busy_s >= busy_prev else st.busy_fraction
            self._autoscaler.observe(role, float(waited.get(role, 0.0)), busy)
            current = self.wanted.get(role, pool.target)
            can_grow = capacity(pool.role, self.ctx.cluster) > 0 or bool(self._autoscaler_present())
            decision = self._autoscaler.decide(role, current, now=now, can_grow=can_grow)
            if decision is not None:
                target, reason = decision
                target = min(max(target, pool.role.lo), pool.role.hi)
                self.ctx.log.event("autoscale", role=role, target=target, previous=current, reason=reason, step=self._step)
                self._set_target(pools, role, target, reason=f"autoscale: {reason}")

    def _autoscaler_present(self) -> bool:
        if self._has_autoscaler is None:
            from raylane import raystate

            self._has_autoscaler = bool(self._quietly(raystate.autoscaler_present))
        return self._has_autoscaler

    def _set_target(self, pools: dict[str, Membership], role: str, n: int, *, reason: str) -> str | None:
        """Make ``n`` the size the pool is wanted at; returns what is missing when it does not fit."""
        assert self.ctx is not None
        pool = pools[role]
        self.wanted[role] = n
        self.ctx.cluster = self._cluster_source()
        fits = capacity(pool.role, self.ctx.cluster)
        pool.resize(n)
        self.ctx.log.event("scale", role=role, target=n, wanted=n, reason=reason)
        short = n - pool.size - fits
        missing = None
        if short > 0:
            need = dict(pool.role.resources)
            if pool.role.accelerator == "require":
                need["GPU"] = max(need.get("GPU", 0.0), 1.0)
            free = "; ".join(f"{nd.node_id[:8]} ({nd.market}) " + ", ".join(f"{k}={nd.available.get(k, 0.0):g}" for k in sorted(need))
                             for nd in self.ctx.cluster.nodes if nd.alive and not nd.draining)
            missing = (f"no room for {short} more {role!r} actor(s) of {{{fmt_res(need)}}} each "
                       f"({fmt_res({k: v * short for k, v in need.items()})} in all); free now: {free or 'nothing'}")
        self._request_capacity(pools)
        return missing

    def _request_capacity(self, pools: dict[str, Membership]) -> None:
        """Ask the Ray autoscaler for the room every pool lacks (one request replaces the last)."""
        assert self.ctx is not None
        bundles, selectors = [], []
        for role, pool in pools.items():
            short = self.wanted.get(role, pool.target) - pool.size - capacity(pool.role, self.ctx.cluster)
            if short <= 0:
                continue
            need = dict(pool.role.resources)
            if pool.role.accelerator == "require":
                need["GPU"] = max(need.get("GPU", 0.0), 1.0)
            market = "on-demand" if pool.role.stateful else "spot"
            bundles += [need] * short
            selectors += [{MARKET_LABEL: market}] * short
        if bundles == (self._requested or []) and self._requested is not None:
            return
        from raylane import raystate

        self._quietly(raystate.request_resources, bundles, selectors)
        self._requested = bundles
        if bundles:
            self.ctx.log.event("autoscaler_request", bundles=len(bundles), autoscaler=self._autoscaler_present())

    def _handle_request(self, req: dict, pools: dict[str, Membership]) -> None:
        from raylane.control import ControlError, check_scale

        assert self._channel is not None and self.ctx is not None
        if req.get("op") != "scale":
            self._quietly(self._channel.respond, req, False, f"unknown request {req.get('op')!r}; this driver serves: scale")
            return
        role, n = req.get("role"), req.get("n")
        try:
            if not isinstance(n, int):
                raise ControlError(f"N must be a whole number of actors, got {n!r}")
            check_scale({r: {"lo": p.role.lo, "hi": p.role.hi} for r, p in pools.items()}, str(role), n)
        except ControlError as exc:
            self._quietly(self._channel.respond, req, False, str(exc))
            return
        missing = self._set_target(pools, role, n, reason="raylane scale")
        if missing is None:
            self._quietly(self._channel.respond, req, True, f"{role!r}: target {n}, resizing now", step=self._step)
            return
        present = self._autoscaler_present()
        how = ("asked the Ray autoscaler for it; the pool grows as nodes join" if present else
               "this cluster has no autoscaler, so the pool grows only when such nodes join (add them, or choose a smaller N)")
        self._quietly(self._channel.respond, req, True, f"{role!r}: target {n}, but {missing}; {how}", step=self._step, missing=True, autoscaler=present)

    def _reports(self, pools: dict[str, Membership]) -> list:
        from raylane.control import PoolReport

        out = []
        for role, pool in pools.items():
            st = pool.status()
            spec = self._autoscaler.specs.get(role)
            out.append(PoolReport(
                role=role, target=st.target, wanted=self.wanted.get(role, st.target), live=st.live, starting=st.starting,
                lo=pool.role.lo, hi=pool.role.hi, nodes=dict(st.nodes), markets=dict(st.markets), busy_fraction=round(st.busy_fraction, 4),
                evictions=[{"at": e.at, "actor": e.actor, "node": e.node_id, "reason": e.reason} for e in st.evictions[-5:]],
                placement_error=st.placement_error, autoscale=None if spec is None else {"min": spec.min, "max": spec.max},
            ))
        return out
