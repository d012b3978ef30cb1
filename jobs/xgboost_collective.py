"""The driver's side of xgboost's collective: the tracker, the address it binds, and how
its errors read.

Where things listen. The tracker runs in the driver process and listens on one address:
127.0.0.1 when every trainer of the group is on the driver's node (always so on an
embedded single-node run), else the node's address, which the trainers on other nodes
must reach. Each trainer, once in the collective, listens for its peers (and for an error
notice) on a port the OS picks; xgboost (up to 3.2 at least) binds those to every
interface and has no setting to change it. Peers connect to the address the tracker saw
a trainer come from, so with a loopback tracker all of the group's traffic stays on the
loopback interface, even though the trainers' listeners are reachable from the network
while a group is up (keep the nodes on a private network: deploy/README.md).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def tracker_host(trainer_nodes: Sequence[str], driver_node: str, node_ip: str) -> str:
    """The address the tracker binds: loopback when every trainer is on the driver's node.

    >>> tracker_host(["n1", "n1"], driver_node="n1", node_ip="10.0.0.5")
    '127.0.0.1'
    >>> tracker_host(["n1", "n2"], driver_node="n1", node_ip="10.0.0.5")
    '10.0.0.5'
    """
    if trainer_nodes and all(node == driver_node for node in trainer_nodes):
        return LOOPBACK
    return node_ip


class Tracker:
    """xgboost's tracker for one group of ``n`` trainers, in this process, on ``host``.

    ``timeout_s`` bounds the group's start and end (the tracker) and, through
    :meth:`worker_args`, each collective operation on the trainers.
    """

    def __init__(self, n: int, timeout_s: int, host: str):
        from xgboost.tracker import RabitTracker

        self.timeout_s = timeout_s
        self.host = host
        self._tracker = RabitTracker(n_workers=n, host_ip=host, sortby="task", timeout=timeout_s)
        self._tracker.start()

    def worker_args(self) -> dict[str, Any]:
        # dmlc_timeout bounds each collective operation, so a peer that vanished without
        # closing its sockets (a node gone from the network) cannot block the others for ever.
        return {**self._tracker.worker_args(), "dmlc_timeout": self.timeout_s}

    def close(self, finished: bool) -> None:
        from xgboost.core import XGBoostError

        try:
            if finished:
                self._tracker.wait_for(self.timeout_s)
        except XGBoostError as exc:
            log.warning("xgboost tracker did not finish cleanly: %s", first_line(str(exc)))
        finally:
            try:
                self._tracker.free()
            except XGBoostError:  # freeing a tracker whose group broke reports the broken group again
                pass


def first_line(text: str) -> str:
    """The gist of an xgboost error: its last few message lines, without the stack trace."""
    lines = [line.strip(" -") for line in text.splitlines() if line.strip() and not line.lstrip().startswith("[bt]") and "Stack trace" not in line]
    return " / ".join(lines[-3:])[:500] if lines else text[:500]


def is_collective_error(text: str) -> bool:
    """An error raised by xgboost's collective (a peer gone, a timeout), not by the data or params."""
    return "/collective/" in text or "Poll timeout" in text
