"""A notice watcher on a spot node turns the cloud's interruption notice (recorded AWS
answers from a local server) into a drain of that very Ray node, with the deadline."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylane.cluster import ClusterView
from raylane.preemption import NodeLeaving, PreemptionMonitor

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def serve_aws(action_time: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, body: str) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_PUT(self):
            self._send(200, "TOKEN")

        def do_GET(self):
            if self.path == "/latest/meta-data/spot/instance-action" and self.headers.get("X-aws-ec2-metadata-token") == "TOKEN":
                return self._send(200, json.dumps({"action": "terminate", "time": action_time}))
            self._send(404, "")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@ray.remote(num_cpus=0.5)
class Agent:
    """What `raylane notices --provider aws` does on a node, as an actor placed there."""

    def check(self, url: str):
        from raylane.notices import NoticeWatcher, make_poller

        notice = NoticeWatcher(make_poller("aws", url), interval_s=0.1).check()
        return ray.get_runtime_context().get_node_id(), None if notice is None else notice.deadline


def test_an_aws_notice_drains_the_node_it_arrives_on(spot_cluster):
    victim = next(n for n in spot_cluster.nodes.values() if n.name == "spot-slow")
    when = datetime.fromtimestamp(int(time.time()) + 120, tz=timezone.utc)
    server = serve_aws(when.strftime("%Y-%m-%dT%H:%M:%SZ"))
    monitor = PreemptionMonitor()
    monitor.poll()  # baseline
    try:
        agent = Agent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(victim.node_id, soft=False)).remote()
        node_id, deadline = ray.get(agent.check.remote(f"http://127.0.0.1:{server.server_address[1]}"), timeout=60)
        assert node_id == victim.node_id and deadline == when.timestamp()
        events: list = []
        end = time.time() + 20
        while time.time() < end and not any(isinstance(e, NodeLeaving) for e in events):
            events += monitor.poll()
            time.sleep(0.2)
        leaving = [e for e in events if isinstance(e, NodeLeaving)]
        assert [e.node_id for e in leaving] == [victim.node_id], events
        assert abs(leaving[0].deadline - when.timestamp()) < 2  # the notice's deadline, not a guess
        view = ClusterView.from_ray()
        assert next(n for n in view.nodes if n.node_id == victim.node_id).draining
    finally:
        server.shutdown()
        spot_cluster.remove(victim)  # the fixture starts a fresh spot-slow for the next test
