"""Cloud preemption notices turned into Ray drains (opt-in; off unless started).

Each cloud announces the end of a spot/preemptible VM on the VM's own metadata service:

- AWS: ``/latest/meta-data/spot/instance-action`` (IMDSv2, token first) answers 404
  until an interruption is scheduled, then ``{"action": "terminate", "time": ...}``,
  two minutes ahead;
- GCP: ``/computeMetadata/v1/instance/preempted`` turns ``TRUE`` about 30 s before the
  VM stops;
- Azure: Scheduled Events list a ``Preempt`` event with its ``NotBefore`` time.

A :class:`NoticeWatcher` runs on a node (``raylane notices --provider aws``, started by
the node's start-up commands), polls one provider, and on a notice drains *this* Ray
node with the notice's deadline. The driver sees the drain like any other (a
``NodeLeaving`` event): stateful roles checkpoint at once, stateless ones move away.

Nothing here runs unless started, and the base URL of every poller is a parameter:
the tests serve recorded answers from a local HTTP server, never the real endpoints.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from datetime import datetime
from typing import Callable

log = logging.getLogger(__name__)

METADATA = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"


@dataclass(frozen=True)
class Notice:
    """A provider's word that this VM goes away at ``deadline`` (epoch seconds)."""

    provider: str
    action: str
    deadline: float
    detail: str


class _Http:
    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Metadata services are link-local: never through an HTTP proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, path: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path, method=method, headers=headers or {})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")


class AwsSpotPoller(_Http):
    """AWS spot interruption notice through IMDSv2."""

    name = "aws"

    def __init__(self, base_url: str = METADATA, timeout_s: float = 2.0):
        super().__init__(base_url, timeout_s)
        self._token: str | None = None
        self._token_at = 0.0

    def _imds_token(self) -> str:
        if self._token is None or time.time() - self._token_at > 3000:
            status, body = self.request("/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "3600"})
            if status != 200:
                raise RuntimeError(f"AWS metadata token request answered {status}: {body[:200]}")
            self._token, self._token_at = body.strip(), time.time()
        return self._token

    def poll(self) -> Notice | None:
        status, body = self.request("/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": self._imds_token()})
        if status == 404:
            return None
        if status == 401:  # the token expired early: fetch a new one next time
            self._token = None
            return None
        if status != 200:
            raise RuntimeError(f"AWS spot instance-action answered {status}: {body[:200]}")
        doc = json.loads(body)
        deadline = datetime.fromisoformat(doc["time"].replace("Z", "+00:00")).timestamp()
        return Notice("aws", doc.get("action", "terminate"), deadline, body.strip())


class GcpPreemptionPoller(_Http):
    """GCP preemption flag (the VM stops about 30 s after it turns TRUE)."""

    name = "gcp"
    notice_s = 30.0

    def __init__(self, base_url: str = GCP_METADATA, timeout_s: float = 2.0):
        super().__init__(base_url, timeout_s)

    def poll(self) -> Notice | None:
        status, body = self.request("/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"})
        if status != 200:
            raise RuntimeError(f"GCP metadata answered {status}: {body[:200]}")
        if body.strip().upper() != "TRUE":
            return None
        return Notice("gcp", "preempt", time.time() + self.notice_s, "instance/preempted=TRUE")


class AzureScheduledEventsPoller(_Http):
    """Azure Scheduled Events: a Preempt event for this VM, with its NotBefore time."""

    name = "azure"

    def __init__(self, base_url: str = METADATA, timeout_s: float = 2.0):
        super().__init__(base_url, timeout_s)

    def poll(self) -> Notice | None:
        status, body = self.request("/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"})
        if status != 200:
            raise RuntimeError(f"Azure scheduled events answered {status}: {body[:200]}")
        for ev in json.loads(body).get("Events", []):
            if ev.get("EventType") in ("Preempt", "Terminate"):
                nb = ev.get("NotBefore") or ""
                deadline = parsedate_to_datetime(nb).timestamp() if nb else time.time() + 30.0
                return Notice("azure", ev["EventType"].lower(), deadline, json.dumps(ev))
        return None


POLLERS = {"aws": AwsSpotPoller, "gcp": GcpPreemptionPoller, "azure": AzureScheduledEventsPoller}


def make_poller(provider: str, base_url: str | None = None):
    if provider not in POLLERS:
        raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(POLLERS)}")
    cls = POLLERS[provider]
    return cls(base_url) if base_url else cls()


def drain_this_node(notice: Notice) -> None:
    """Drain the Ray node this process runs on, with the notice's deadline."""
    import ray

    from raylane import raystate

    node_id = ray.get_runtime_context().get_node_id()
    raystate.drain_node(node_id, max(0.0, notice.deadline - time.time()), reason="preemption",
                        message=f"{notice.provider} {notice.action} notice: {notice.detail[:200]}")


class NoticeWatcher:
    """Polls a provider every ``interval_s``; calls ``on_notice`` once, on the first notice.
    Poll errors are logged and retried (a metadata hiccup must not stop the watch)."""

    def __init__(self, poller, *, interval_s: float = 5.0, on_notice: Callable[[Notice], None] = drain_this_node):
        self.poller = poller
        self.interval_s = interval_s
        self.on_notice = on_notice
        self.notice: Notice | None = None
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> Notice | None:
        """One poll; acts on a first notice."""
        try:
            notice = self.poller.poll()
        except Exception as exc:  # noqa: BLE001
            self.errors += 1
            log.warning("%s notice poll failed: %s", getattr(self.poller, "name", "?"), exc)
            return None
        if notice is not None and self.notice is None:
            self.notice = notice
            log.warning("preemption notice from %s: %s at %.0f", notice.provider, notice.action, notice.deadline)
            self.on_notice(notice)
        return notice

    def run(self) -> Notice:
        """Block until a notice arrives (or :meth:`stop`)."""
        while not self._stop.is_set() and self.notice is None:
            self.check()
            self._stop.wait(self.interval_s)
        return self.notice  # type: ignore[return-value]

    def start(self) -> "NoticeWatcher":
        self._thread = threading.Thread(target=self.run, name="raylane-notices", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
