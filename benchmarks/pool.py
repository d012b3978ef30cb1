"""Pool overhead: raylane's TaskPool against Ray's own ray.util.ActorPool, side by side.

Both map the same calls over the same number of actors on one local Ray. raylane
adds eviction, replacement, per-call deadlines and exactly-once bookkeeping; this
measures what that costs per call. Prints wall times and the ratio raylane / Ray.

    python benchmarks/pool.py [--actors 2] [--calls 2000] [--work-ms 0,5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray.util import ActorPool as RayActorPool

from raylane.api import RoleSpec
from raylane.api import TaskPool


@ray.remote
class Echo:
    def work(self, x: int, ms: float) -> int:
        if ms:
            end = time.perf_counter() + ms / 1000
            while time.perf_counter() < end:
                pass
        return x


def time_ray(actors, calls: int, ms: float) -> float:
    pool = RayActorPool(actors)
    t0 = time.perf_counter()
    out = list(pool.map(lambda a, x: a.work.remote(x, ms), range(calls)))
    assert out == list(range(calls))
    return time.perf_counter() - t0


def time_raylane(pool: TaskPool, calls: int, ms: float) -> float:
    t0 = time.perf_counter()
    tickets = [pool.submit("work", x, ms) for x in range(calls)]
    done = pool.gather(tickets, timeout_s=600)
    assert [done[t] for t in tickets] == list(range(calls))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--work-ms", default="0,5")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2 * args.actors + 1, include_dashboard=False, log_to_driver=False)
    raw = [Echo.options(num_cpus=1).remote() for _ in range(args.actors)]
    ray.get([a.work.remote(0, 0) for a in raw])
    pool = TaskPool(RoleSpec("echo", {"CPU": 1.0}, count=args.actors), Echo, call_timeout_s=600)
    pool.wait_ready(120)
    print(f"{'work/call':>10} {'calls':>6} {'ray.util s':>11} {'raylane s':>10} {'ratio':>6} {'raylane us/call':>16}")
    for ms in [float(x) for x in args.work_ms.split(",")]:
        calls = args.calls if ms == 0 else max(200, args.calls // 5)
        r, l = [], []
        for _ in range(args.repeats):
            r.append(time_ray(raw, calls, ms))
            l.append(time_raylane(pool, calls, ms))
        rm, lm = statistics.median(r), statistics.median(l)
        print(f"{ms:>8.1f}ms {calls:>6} {rm:>11.3f} {lm:>10.3f} {lm / rm:>6.2f} {1e6 * lm / calls:>16.0f}")
    pool.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
