"""A real multi-node Ray cluster on this machine (``raylane dev-cluster``; its command line
is :mod:`raylane.cli.devcluster`):

- :mod:`raylane.devcluster.state`: the record in ``<dir>/state.json`` (default
  ``~/.raylane/dev-cluster``, or ``RAYLANE_DEV_CLUSTER_DIR``) that ``raylane submit``
  reads to find the cluster, and ``<dir>/connection.env`` for Ray's own tools.
- :mod:`raylane.devcluster.nodes`: starting and stopping the ``ray start`` processes,
  what listens where, and how ``down`` finds exactly its own processes.
"""

from raylane.devcluster.nodes import MAX_NODES, down, live_nodes, processes, up
from raylane.devcluster.state import (CONNECTION_FILE, DIR_ENV, MARKER_ENV, DevClusterError, DevClusterState, NodeRecord,
                                      connection_env, default_dir, submit_command, write_connection_file)

__all__ = [
    "CONNECTION_FILE", "DIR_ENV", "MARKER_ENV", "MAX_NODES", "DevClusterError", "DevClusterState", "NodeRecord",
    "connection_env", "default_dir", "down", "live_nodes", "processes", "submit_command", "up", "write_connection_file",
]
