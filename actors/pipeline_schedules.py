"""Pipeline schedules: which forward and backward micro-batch operation each stage runs, in order.

Pure functions, no Ray, no torch. A pipeline has ``p`` stages (actors) and the model is
cut into ``p * v`` *virtual stages*: stage ``s`` holds chunks ``c = 0 .. v-1``, chunk
``c`` being virtual stage ``c * p + s`` (the looped placement of interleaved 1F1B and
breadth-first pipelines). A batch is ``m`` micro-batches. Every schedule gives each
stage an ordered list of :class:`Op`: ``F`` (forward of micro-batch ``mb`` through chunk
``chunk``), ``B`` (its backward) and one final ``S`` (the optimizer step).

Schedules (``SCHEDULES``):

* ``gpipe``: all forwards, then all backwards. Peak live activations ``m`` per stage.
* ``1f1b``: ``p - s - 1`` warm-up forwards, then one forward one backward, then the
  rest of the backwards. Peak live activations ``p - s <= p``.
* ``interleaved``: interleaved 1F1B over ``v`` chunks per stage (Megatron-LM's order;
  micro-batches go in groups of ``p``, so ``m`` must be a multiple of ``p``).
* ``bfs``: looped breadth-first ("Breadth-First Pipeline Parallelism", Lamy-Poirier
  2022): every micro-batch through chunk 0, then through chunk 1, ..., then the
  backwards in the reverse chunk order.

:func:`simulate` runs a schedule on an idealised clock (each stage runs its list in
order; an operation starts when its stage is free and its inputs exist) and reports the
bubble fraction; :func:`bubble_theory` gives ``(p-1)/(m+p-1)`` for gpipe and 1f1b and
``(p-1)/(v*m+p-1)`` for interleaved and bfs. :func:`submission_order` merges the
stages' lists into one order in which every operation comes after the operations it
needs, which is the order a driver submits them in.

>>> [str(op) for op in one_f_one_b(2, 3).ops[0]]
['F0', 'F1', 'B0', 'F2', 'B1', 'B2', 'S']
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "bfs")
LOOPED = ("interleaved", "bfs")  # the schedules that use v > 1 chunks per stage


class Op(NamedTuple):
    """One operation of a stage: ``kind`` F (forward), B (backward) or S (optimizer step)."""

    kind: str
    mb: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.kind == "S":
            return "S"
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Every stage's ordered operations for one batch."""

    name: str
    p: int
    m: int
    v: int
    ops: tuple[tuple[Op, ...], ...]
    """``ops[s]``: stage ``s``'s operations, in the order it runs them."""

    @property
    def virtual_stages(self) -> int:
        return self.p * self.v

    def vstage(self, stage: int, chunk: int) -> int:
        """The virtual stage (model piece, in model order) that ``chunk`` of ``stage`` holds."""
        return chunk * self.p + stage

    def where(self, vstage: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding virtual stage ``vstage``."""
        return vstage % self.p, vstage // self.p


def _check_counts(name: str, p: int, m: int, v: int) -> None:
    for key, value in (("stages", p), ("micro-batches", m), ("chunks", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key} must be a whole number >= 1, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order), then the step.

    >>> [str(op) for op in gpipe(2, 2).ops[1]]
    ['F0', 'F1', 'B0', 'B1', 'S']
    """
    _check_counts("gpipe", p, m, 1)
    stage = tuple([Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)] + [Op("S")])
    return Schedule("gpipe", p, m, 1, tuple(stage for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down.

    ``m < p`` is refused: there would be no steady phase, only a larger bubble than
    gpipe's for the same memory; use gpipe or more micro-batches.
    """
    _check_counts("1f1b", p, m, 1)
    if m < p:
        raise ValueError(f"1f1b: micro-batches m={m} < stages p={p} leaves no steady one-forward-one-backward phase; "
                         f"use m >= {p} or the gpipe schedule")
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - warm, m)] + [Op("S")]
        out.append(tuple(ops))
    return Schedule("1f1b", p, m, 1, tuple(out))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B over ``v`` chunks per stage, in Megatron-LM's order.

    Forward number ``k`` (of ``m * v``) on a stage is micro-batch ``(k // (p v)) p + k % p``
    through chunk ``(k // p) % v``; backwards go through the chunks in reverse. A stage
    warms up with ``2 (p - s - 1) + (v - 1) p`` forwards (all of them when ``m == p``).
    ``m`` must be a multiple of ``p``: micro-batches move through the chunks in groups of ``p``.
    """
    _check_counts("interleaved", p, m, v)
    if m % p:
        valid = ", ".join(str(p * k) for k in range(1, 4))
        raise ValueError(f"interleaved: micro-batches m={m} must be a multiple of stages p={p} "
                         f"(micro-batches pass the chunks in groups of p); valid m: {valid}, ...")
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    out = []
    for s in range(p):
        warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        ops = [Op("F", mb(k), chunk(k, True)) for k in range(warm)]
        for k in range(total - warm):
            ops += [Op("F", mb(warm + k), chunk(warm + k, True)), Op("B", mb(k), chunk(k, False))]
        ops += [Op("B", mb(k), chunk(k, False)) for k in range(total - warm, total)] + [Op("S")]
        out.append(tuple(ops))
    return Schedule("interleaved", p, m, v, tuple(out))


def breadth_first(p: int, m: int, v: int) -> Schedule:
    """Looped breadth-first: every micro-batch through chunk 0, then chunk 1, ...; then the
    backwards chunk by chunk in reverse. Peak live activations ``v * m`` per stage (the
    price of its small bubble and of overlapping data-parallel gradient reduction).

    >>> [str(op) for op in breadth_first(2, 2, 2).ops[0]]
    ['F0', 'F1', 'F0.1', 'F1.1', 'B0.1', 'B1.1', 'B0', 'B1', 'S']
    """
    _check_counts("bfs", p, m, v)
    ops = [Op("F", i, c) for c in range(v) for i in range(m)]
    ops += [Op("B", i, c) for c in reversed(range(v)) for i in range(m)] + [Op("S")]
    return Schedule("bfs", p, m, v, tuple(tuple(ops) for _ in range(p)))


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``); ``v`` only for interleaved and bfs."""
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name), SCHEDULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown schedule {name!r}.{hint} Valid schedules: {', '.join(SCHEDULES)}")
    if name not in LOOPED and v != 1:
        raise ValueError(f"{name}: chunks v={v} applies only to the looped schedules ({', '.join(LOOPED)}); use v=1")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return breadth_first(p, m, v)


# ------------------------------------------------------------------------- analysis


def deps(sched: Schedule, stage: int, op: Op) -> list[tuple[int, Op]]:
    """The ``(stage, op)`` whose results ``op`` on ``stage`` needs: the previous virtual
    stage's forward, the next virtual stage's backward and this chunk's own forward."""
    if op.kind == "S":
        return [(stage, o) for o in sched.ops[stage] if o.kind == "B"]
    j, last = sched.vstage(stage, op.chunk), sched.virtual_stages - 1
    if op.kind == "F":
        if j == 0:
            return []
        s, c = sched.where(j - 1)
        return [(s, Op("F", op.mb, c))]
    out = [(stage, Op("F", op.mb, op.chunk))]
    if j < last:
        s, c = sched.where(j + 1)
        out.append((s, Op("B", op.mb, c)))
    return out


def validate(sched: Schedule) -> None:
    """Every stage forwards and backwards each micro-batch exactly once per chunk and steps
    once, last; a ValueError names the first stage that does not."""
    want = sorted([Op(k, i, c) for k in "FB" for i in range(sched.m) for c in range(sched.v)])
    for s, ops in enumerate(sched.ops):
        if not ops or ops[-1] != Op("S") or sum(o.kind == "S" for o in ops) != 1:
            raise ValueError(f"{sched.name}: stage {s} must end with exactly one optimizer step S")
        got = sorted(o for o in ops if o.kind != "S")
        if got != want:
            raise ValueError(f"{sched.name}: stage {s} runs {len(got)} F/B ops, not each of the {len(want)} exactly once")


@dataclass(frozen=True)
class Timeline:
    """A schedule run on the idealised clock."""

    start: dict[tuple[int, Op], float]
    end: dict[tuple[int, Op], float]
    makespan: float
    busy: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """Share of stage-time spent idle: ``1 - sum(busy) / (p * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(sched: Schedule, t_fwd: float = 1.0, t_bwd: float = 2.0, t_comm: float = 0.0) -> Timeline:
    """Run ``sched``: each stage takes its operations in order; one starts when its stage is
    free and its inputs (:func:`deps`) are done, plus ``t_comm`` for an input from another
    stage. ``t_fwd``/``t_bwd`` are the time of one chunk's forward/backward (the step
    takes no time). Raises ValueError naming the stuck operations on a deadlock, i.e. when
    an order cannot run (a backward before its forward, a cycle between stages)."""
    validate(sched)
    dur = {"F": t_fwd, "B": t_bwd, "S": 0.0}
    pos = [0] * sched.p
    free = [0.0] * sched.p
    start: dict[tuple[int, Op], float] = {}
    end: dict[tuple[int, Op], float] = {}
    left = sum(len(o) for o in sched.ops)
    while left:
        moved = False
        for s in range(sched.p):
            while pos[s] < len(sched.ops[s]):
                op = sched.ops[s][pos[s]]
                need = deps(sched, s, op)
                if any(d not in end for d in need):
                    break
                t0 = max([free[s]] + [end[d] + (t_comm if d[0] != s else 0.0) for d in need])
                start[(s, op)], end[(s, op)] = t0, t0 + dur[op.kind]
                free[s] = end[(s, op)]
                pos[s] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = ", ".join(f"stage {s}: {sched.ops[s][pos[s]]}" for s in range(sched.p) if pos[s] < len(sched.ops[s]))
            raise ValueError(f"{sched.name}: deadlock, no stage can go on ({stuck})")
    busy = tuple(sum(end[(s, o)] - start[(s, o)] for o in sched.ops[s]) for s in range(sched.p))
    return Timeline(start, end, max(end.values()), busy)


def peak_activations(sched: Schedule) -> list[int]:
    """Per stage: the most micro-batch-chunks forwarded and not yet backwarded at once
    (each holds its activations until its backward)."""
    out = []
    for ops in sched.ops:
        live = peak = 0
        for o in ops:
            live += (o.kind == "F") - (o.kind == "B")
            peak = max(peak, live)
        out.append(peak)
    return out


def bubble_theory(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction: ``(p-1)/(m+p-1)`` (gpipe, 1f1b) or ``(p-1)/(v m+p-1)``
    (interleaved, bfs; with ``m >= p``)."""
    k = v if name in LOOPED else 1
    return (p - 1) / (k * m + p - 1)


def submission_order(sched: Schedule) -> list[tuple[int, Op]]:
    """All ``(stage, op)`` in one order that keeps each stage's own order and puts every
    operation after those it needs: the order of their start on the simulated clock."""
    tl = simulate(sched)
    index = {(s, o): i for s, ops in enumerate(sched.ops) for i, o in enumerate(ops)}
    return sorted(tl.start, key=lambda so: (tl.start[so], index[so], so[0]))
