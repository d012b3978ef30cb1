"""GNN sampler actor: turns seed nodes into sampled, feature-complete mini-batches.

A sampler reads the graph from the object store (one copy per node, shared zero-copy by
every sampler there) and is otherwise stateless: a batch is named by (epoch, part, index)
and is the same whichever sampler makes it, so a batch lost with its sampler is simply
made again by another one or by the replacement, and an epoch visits every training seed
exactly once however many samplers died during it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import ray

from raylane.actors.allocator import keep_freed_memory
from raylane.actors.graph import SharedGraph
from raylane.actors.sampling import batch_rng, batch_seeds, check_fanouts, sample_subgraph


@dataclass(frozen=True)
class SamplerConfig:
    """What one sampler needs to know."""

    fanouts: tuple[int, ...]
    """Neighbours sampled per node, per layer (hop 1 first)."""
    batch_size: int
    """Seed nodes per batch."""
    seed: int = 0
    """Base seed of the seed order and of the neighbour sampling."""
    home_part: int = 0
    """The METIS part whose seeds :meth:`GNNSampler.sample` walks through."""

    def __post_init__(self):
        check_fanouts(self.fanouts)
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")


def make_batch(graph: SharedGraph, seeds: np.ndarray, fanouts, rng: np.random.Generator, scratch: np.ndarray | None = None) -> dict:
    """Sample around ``seeds`` and gather what the trainer needs: features of every sampled
    node, labels of the seeds, the sub-graph's edges in local ids."""
    sub = sample_subgraph(graph.indptr, graph.indices, seeds, fanouts, rng, scratch)
    n_id = sub["n_id"]
    # One vectorised gather from the shared array; np.take copies whole rows, where x[n_id]
    # goes element by element (2-3x slower for rows of a few dozen features).
    sub["x"] = np.take(graph.x, n_id, axis=0)
    sub["y"] = graph.y[seeds]
    sub["batch_size"] = len(seeds)
    return sub


class GNNSampler:
    """Ray actor; constructed with its config slice and the shared graph."""

    def __init__(self, config: SamplerConfig, graph: SharedGraph):
        self.config = config
        self.graph = graph
        if not 0 <= config.home_part < graph.num_parts:
            raise ValueError(f"home_part={config.home_part}: the graph has parts 0..{graph.num_parts - 1}")
        self._local = threading.local()  # one relabelling scratch array per calling thread
        self._lock = threading.Lock()  # guards the cursor and the counters
        self._cursor = (0, 0)  # (epoch, index) of sample()'s next batch
        self._perm = (None, None)  # ((epoch, part), its seed order), swapped whole
        self.batches = 0
        self.busy_s = 0.0

    def _scratch(self) -> np.ndarray:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = np.full(self.graph.num_nodes, -1, dtype=np.int64)
        return s

    def batch(self, epoch: int, part: int, index: int) -> dict:
        """Batch ``index`` of ``part`` in ``epoch`` (see :func:`raylane.actors.sampling.batch_seeds`)."""
        t0 = time.perf_counter()
        c = self.config
        seeds = self._seeds(epoch, part, index)
        if len(seeds) == 0:
            raise IndexError(f"part {part} has no batch {index} in epoch {epoch} (batch_size={c.batch_size})")
        out = make_batch(self.graph, seeds, c.fanouts, batch_rng(seed=c.seed, epoch=epoch, part=part, index=index), self._scratch())
        out["key"] = (epoch, part, index)
        out["sampler_pid"] = os.getpid()
        with self._lock:
            self.batches += 1
            self.busy_s += time.perf_counter() - t0
        return out

    def sample(self, batch_size: int | None = None) -> dict:
        """The next batch of this sampler's home part, epoch after epoch."""
        c = self.config
        bs = batch_size or c.batch_size
        seeds_all = self.graph.train_seeds[c.home_part]
        if len(seeds_all) == 0:
            raise ValueError(f"part {c.home_part} has no training seeds")
        with self._lock:
            epoch, index = self._cursor
            if index * bs >= len(seeds_all):
                epoch, index = epoch + 1, 0
            self._cursor = (epoch, index + 1)
        seeds = batch_seeds(seeds_all, seed=c.seed, epoch=epoch, part=c.home_part, index=index, batch_size=bs)
        return make_batch(self.graph, seeds, c.fanouts, batch_rng(seed=c.seed, epoch=epoch, part=c.home_part, index=index), self._scratch())

    def _seeds(self, epoch: int, part: int, index: int) -> np.ndarray:
        c = self.config
        if not 0 <= part < self.graph.num_parts:
            raise ValueError(f"part {part}: the graph has parts 0..{self.graph.num_parts - 1}")
        key, perm = self._perm
        if key != (epoch, part):  # one permutation per (epoch, part), reused across its batches
            seeds = self.graph.train_seeds[part]
            perm = batch_seeds(seeds, seed=c.seed, epoch=epoch, part=part, index=0, batch_size=len(seeds) or 1)
            self._perm = ((epoch, part), perm)
        return perm[index * c.batch_size : (index + 1) * c.batch_size]

    def info(self) -> dict:
        """Process id, batches made, seconds spent making them, CPU seconds of the process (all threads)."""
        with self._lock:
            return {"pid": os.getpid(), "batches": self.batches, "busy_s": self.busy_s, "cpu_s": time.process_time()}


# Two calls at a time: while one call's batch is being stored (Ray copies the 5-15 MiB
# return into the object store and seals it after the method returns, several ms during
# which the sampler would otherwise sit idle) the next call is already sampling. The
# sampling releases the GIL in numpy's loops; the per-call state (relabelling scratch,
# cursor, counters) is per thread or locked.
@ray.remote(max_concurrency=2)
class GNNSamplerActor(GNNSampler):
    """:class:`GNNSampler` in a process of its own, whose allocator keeps the pages of
    freed batches for the next ones (see :mod:`raylane.actors.allocator`)."""

    def __init__(self, config: SamplerConfig, graph: SharedGraph):
        keep_freed_memory()
        super().__init__(config, graph)
