"""Test and benchmark support for raylane (``raylane.testing``).

Nothing here is used by raylane's own code paths (the CLI, the driver, the jobs): only
``tests/`` and ``benchmarks/`` import it. :mod:`raylane.testing.spotmarket` simulates a
spot market on a real multi-node Ray cluster on this machine.
"""
