"""Connecting to Ray: an embedded local instance, or an existing cluster.

Embedded means ``ray.init(address="local")``: a private Ray for this process that
never joins another cluster on the machine. The dashboard, when asked for, binds to
127.0.0.1. Ray's token authentication stays as Ray sets it (on, for local starts).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def connect(address: str | None = None, *, num_cpus: int | None = None, dashboard: bool = False, quiet: bool = True) -> str:
    """Start or join Ray; returns the GCS address. Does nothing if already connected."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict = {"log_to_driver": not quiet, "configure_logging": True, "logging_level": logging.WARNING if quiet else logging.INFO}
    if address in (None, "", "local"):
        kwargs.update(address="local", include_dashboard=dashboard, num_cpus=num_cpus)
        if dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"
    else:
        kwargs["address"] = address
    ray.init(**kwargs)
    from raylane.security import loose_token_warning  # Ray has just settled on its auth mode and token

    if problem := loose_token_warning():
        log.warning(problem)
    return ray.get_runtime_context().gcs_address


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
