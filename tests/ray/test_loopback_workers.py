"""What the workers of a single-node run listen on: xgboost's tracker and collective, and
the pipeline stages' gloo groups, read from the processes' sockets (psutil) while they run.

Ray's own listeners (GCS, raylet, each worker's gRPC server) are another matter: every
assertion here is about the sockets a process opened after a baseline taken before the
group formed, so Ray's are left out. Also: a gloo peer that died or went silent ends a
stage's wait with a clear error instead of a hang.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time

import psutil
import pytest
import ray
import torch
from ray.exceptions import RayTaskError

from raylane.actors import pipeline_schedules as S
from raylane.actors import gpt
from raylane.actors.pipeline_stage import LinkedStage, StageConfig, connect_linked, pieces_for, train_batch
from raylane.driver import Driver, DriverConfig
from raylane.jobs.xgboost import DataConfig, XGBoostJobConfig, XGBoostWorkload
from raylane.actors.pipeline_split import split_virtual
from harness import ranks_now  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

WILDCARD = {"0.0.0.0", "::"}

Sock = tuple[int, str, int]  # (pid, address, port)


def _table(pids: list[int]) -> list:
    """The inet sockets of ``pids``, from one read of the system's socket table (a read per
    pid costs as much, since each reads the whole namespace's table: with the many sockets
    a long test session leaves behind, reading once keeps the sampler fast)."""
    wanted = set(pids)
    return [c for c in psutil.net_connections(kind="inet") if c.pid in wanted]


def listening(pids: list[int]) -> set[Sock]:
    """The TCP sockets listening in ``pids`` (those gone meanwhile are skipped)."""
    return {(c.pid, _plain(c.laddr.ip), c.laddr.port) for c in _table(pids) if c.status == psutil.CONN_LISTEN}


def connected(pids: list[int]) -> set[tuple[int, str, str, int]]:
    """(pid, local address, remote address, remote port) of the established TCP connections of ``pids``."""
    return {(c.pid, _plain(c.laddr.ip), _plain(c.raddr.ip), c.raddr.port) for c in _table(pids) if c.status == psutil.CONN_ESTABLISHED and c.raddr}


def _plain(ip: str) -> str:
    return ip.removeprefix("::ffff:")  # an IPv4 address seen through a dual-stack socket


def loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


# ---------------------------------------------------------------- xgboost


class ProbedXGBoost(XGBoostWorkload):
    """The real workload, with the sockets of this process and the trainers recorded as each
    collective session starts and, by a sampler thread, while it runs."""

    def __init__(self, config: XGBoostJobConfig):
        super().__init__(config)
        self.sessions: list[dict] = []
        self._samplers: list[threading.Thread] = []

    def _start_stream(self):
        pids = list(ranks_now(self.ctx.run_dir, "xgboost_group", "pids").values())
        before = listening([os.getpid(), *pids])
        stream = super()._start_stream()
        # The tracker listens from its start on; the trainers open theirs as they join.
        session = {"host": stream.tracker.host, "pids": pids, "before": before, "tracker": listening([os.getpid()]) - before, "listen": set(), "conns": set()}
        self.sessions.append(session)

        def sample() -> None:
            while not session.get("over"):
                table = _table(pids)
                session["listen"] |= {(c.pid, _plain(c.laddr.ip), c.laddr.port) for c in table if c.status == psutil.CONN_LISTEN} - before
                session["conns"] |= {(c.pid, _plain(c.laddr.ip), _plain(c.raddr.ip), c.raddr.port) for c in table if c.status == psutil.CONN_ESTABLISHED and c.raddr}
                time.sleep(0.01)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        self._samplers.append(thread)
        return stream

    def _end_stream(self, outcome: str) -> None:
        self._stop_sampling()
        super()._end_stream(outcome)

    def close(self) -> None:
        self._stop_sampling()
        super().close()

    def _stop_sampling(self) -> None:
        for session in self.sessions:
            session["over"] = True
        for thread in self._samplers:
            thread.join(timeout=30)


def test_xgboost_tracker_and_collective_links_stay_on_loopback(ray_local, tmp_path):
    # Big enough that the session lasts about 5 s of boosting on this machine (1.4 s for 40
    # rounds): the sampler sees the group's links up even when a long test session has left
    # the socket table large and each read of it slow.
    data = DataConfig(source="synthetic:classification", rows=100_000, num_features=16, seed=5)
    conf = XGBoostJobConfig(data=data, num_boost_round=160, checkpoint_every=40, trainers=2, params={"eval_metric": ["logloss"]})
    conf.driver = DriverConfig(run_name="loopback", runs_dir=str(tmp_path), checkpoint_every_steps=1, progress=False, tensorboard=False)
    workload = ProbedXGBoost(conf)
    summary = Driver(workload, conf.driver).run()
    assert summary["state"] == "finished" and summary["final_metrics"]["round"] == 160

    assert workload.sessions, "no collective session started"
    node_ip = ray.util.get_node_ip_address()
    for s in workload.sessions:
        # Every trainer is on this node: the tracker binds loopback, and only loopback.
        assert s["host"] == "127.0.0.1"
        assert s["tracker"], "the tracker opened no listening socket in the driver process"
        assert all(loopback(ip) for _, ip, _ in s["tracker"]), f"tracker listens beyond loopback: {sorted(s['tracker'])}"
        # The trainers' collective listeners: xgboost binds them to every interface (it has
        # no setting for it), so the check is that none is bound to the node's own address
        # and that every link of the group was made over loopback.
        assert not {ip for _, ip, _ in s["listen"]} - WILDCARD - {ip for _, ip, _ in s["listen"] if loopback(ip)}, f"trainers listen on a routable address: {sorted(s['listen'])}"
        ports = {port for _, _, port in s["tracker"] | s["listen"]}
        links = {c for c in s["conns"] if c[3] in ports}
        assert all(loopback(local) and loopback(remote) for _, local, remote, _ in links), f"collective links off loopback (node {node_ip}): {sorted(links)}"
    sampled = [s for s in workload.sessions if s["listen"]]
    assert sampled, "the sampler never saw a trainer in the collective"
    assert any(c[3] in {p for _, _, p in s["tracker"] | s["listen"]} for s in sampled for c in s["conns"]), "no collective link was seen"


# ---------------------------------------------------------------- gloo between pipeline stages

MODEL = gpt.GPTConfig(vocab=32, seq_len=16, d_model=32, n_heads=2, n_blocks=2, seed=3)
M, B = 4, 2


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, MODEL.vocab, (M, B, MODEL.seq_len + 1), generator=g)
    return data[..., :-1].contiguous(), data[..., 1:].contiguous()


def loaded_stages(cfg: StageConfig, sched: S.Schedule) -> list:
    stages = [LinkedStage.options(num_cpus=0.25).remote(cfg) for _ in range(sched.p)]
    pieces = pieces_for(sched, split_virtual([1.0] * MODEL.n_layers, [1.0] * sched.p, sched.v))
    ray.get([h.load.remote(pieces[s], sched.virtual_stages - 1) for s, h in enumerate(stages)], timeout=120)
    return stages


def test_gloo_group_of_one_node_listens_only_on_loopback(ray_local):
    sched = S.make("1f1b", 2, M)
    stages = loaded_stages(StageConfig(MODEL), sched)
    pids = [w["pid"] for w in ray.get([h.where.remote() for h in stages], timeout=60)]
    before = listening(pids)
    connect_linked([stages], "gloo", 60)
    opened = listening(pids) - before
    links = {c for c in connected(pids) if c[3] in {port for _, _, port in opened}}
    out = train_batch([stages], sched, [batch(1)], dispatch="linked", timeout_s=60)
    assert len(out["losses"][0]) == M
    try:
        assert opened, "the gloo group opened no listening socket"
        assert all(loopback(ip) for _, ip, _ in opened), f"gloo listens beyond loopback: {sorted(opened)}"
        assert links and all(loopback(local) and loopback(remote) for _, local, remote, _ in links), f"gloo links off loopback: {sorted(links)}"
    finally:
        for h in stages:
            ray.kill(h)


def test_gloo_wait_on_a_silent_peer_ends_with_a_clear_error(ray_local):
    sched = S.make("1f1b", 2, M)
    stages = loaded_stages(StageConfig(MODEL, link_timeout_s=2.0), sched)
    connect_linked([stages], "gloo", 60)
    tokens, targets = batch(2)
    # Only stage 0 runs its part of the batch: stage 1 is alive but never sends the gradients.
    first = stages[0].run.remote(sched, tokens, None, 1.0 / M, 60)
    with pytest.raises(RayTaskError, match=r"stage 0: gloo receive of message \d+ from stage 1 failed .* link timeout of 2 s"):
        ray.get(first, timeout=60)
    for h in stages:
        ray.kill(h)


def test_gloo_wait_on_a_dead_peer_ends_with_a_clear_error(ray_local):
    sched = S.make("1f1b", 2, M)
    stages = loaded_stages(StageConfig(MODEL), sched)
    connect_linked([stages], "gloo", 60)
    tokens, targets = batch(3)
    first = stages[0].run.remote(sched, tokens, None, 1.0 / M, 60)
    ray.kill(stages[1])
    with pytest.raises(RayTaskError, match=r"stage 0: gloo .* failed after .* closed its connection"):
        ray.get(first, timeout=60)
    ray.kill(stages[0])
