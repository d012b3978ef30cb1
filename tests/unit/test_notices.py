"""Cloud preemption-notice pollers against recorded metadata answers served from a local
HTTP server (127.0.0.1), never the real endpoints. The server checks the headers each
provider requires, so a poller that forgets one fails here as it would in the cloud."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raylane.notices import AwsSpotPoller, AzureScheduledEventsPoller, GcpPreemptionPoller, NoticeWatcher, make_poller

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Answers as the providers document them.
AWS_ACTION = {"action": "terminate", "time": "2026-12-02T20:02:00Z"}
AZURE_EVENTS = {
    "DocumentIncarnation": 2,
    "Events": [
        {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["spot-worker-3"], "EventStatus": "Scheduled", "NotBefore": "Wed, 02 Dec 2026 20:01:30 GMT",
         "Description": "", "EventSource": "Platform", "DurationInSeconds": -1},
    ],
}
AZURE_NONE = {"DocumentIncarnation": 1, "Events": []}


class Metadata:
    """A fake metadata service: `preempted` flips what it answers."""

    def __init__(self):
        self.preempted = False
        self.requests: list[tuple[str, str]] = []
        meta = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                meta.requests.append(("PUT", self.path))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(200, "TOKEN-123")
                return self._send(400, "bad token request")

            def do_GET(self):
                meta.requests.append(("GET", self.path))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "TOKEN-123":
                        return self._send(401, "")
                    return self._send(200, json.dumps(AWS_ACTION)) if meta.preempted else self._send(404, "Not Found")
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header.")
                    return self._send(200, "TRUE" if meta.preempted else "FALSE")
                if self.path.startswith("/metadata/scheduledevents"):
                    if self.headers.get("Metadata") != "true" or "api-version=" not in self.path:
                        return self._send(400, '{"error": "Bad request"}')
                    return self._send(200, json.dumps(AZURE_EVENTS if meta.preempted else AZURE_NONE))
                return self._send(404, "no such path")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def metadata():
    m = Metadata()
    yield m
    m.close()


def test_aws_poller_uses_imdsv2_and_reads_the_interruption_time(metadata):
    poller = AwsSpotPoller(metadata.url)
    assert poller.poll() is None and poller.poll() is None  # 404: nothing scheduled
    metadata.preempted = True
    notice = poller.poll()
    assert notice.provider == "aws" and notice.action == "terminate"
    assert notice.deadline == datetime(2026, 12, 2, 20, 2, tzinfo=timezone.utc).timestamp()
    assert metadata.requests.count(("PUT", "/latest/api/token")) == 1  # the token is reused


def test_gcp_poller_sends_the_flavor_header_and_gives_thirty_seconds(metadata):
    poller = GcpPreemptionPoller(metadata.url)
    assert poller.poll() is None
    metadata.preempted = True
    t0 = time.time()
    notice = poller.poll()
    assert notice.provider == "gcp" and t0 + 29 <= notice.deadline <= time.time() + 31


def test_azure_poller_reads_preempt_events_and_their_not_before(metadata):
    poller = AzureScheduledEventsPoller(metadata.url)
    assert poller.poll() is None
    metadata.preempted = True
    notice = poller.poll()
    assert notice.provider == "azure" and notice.action == "preempt"
    assert notice.deadline == datetime(2026, 12, 2, 20, 1, 30, tzinfo=timezone.utc).timestamp()
    assert "spot-worker-3" in notice.detail


def test_watcher_acts_once_on_the_first_notice_and_survives_errors(metadata):
    seen = []
    watcher = NoticeWatcher(make_poller("gcp", metadata.url), interval_s=0.05, on_notice=seen.append).start()
    time.sleep(0.3)
    assert seen == []
    metadata.preempted = True
    deadline = time.time() + 10
    while not seen and time.time() < deadline:
        time.sleep(0.05)
    watcher.stop()
    assert len(seen) == 1 and seen[0].provider == "gcp"

    broken = NoticeWatcher(make_poller("aws", "http://127.0.0.1:9"), interval_s=0.01, on_notice=seen.append)  # nothing listens
    assert broken.check() is None and broken.errors == 1


def test_unknown_provider_is_refused():
    with pytest.raises(ValueError, match="unknown provider 'ibm'; choose one of aws, gcp, azure"):
        make_poller("ibm")
