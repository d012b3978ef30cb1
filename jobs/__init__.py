"""Workload entrypoints."""
