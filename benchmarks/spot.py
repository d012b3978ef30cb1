"""Goodput on spot capacity: each workload under a preemption schedule, with and without
notice, against the same job fault-free and against restart-everything recovery.

    python benchmarks/spot.py                                   # one preemption a minute, 30 s notice, 4 min runs
    python benchmarks/spot.py --every 30 --notice 10 --duration 100 --workloads graphsage xgboost

One process tree: a simulated cluster (``raylane.testing.spotmarket``: an on-demand head with 2
CPUs and two spot nodes with 2 CPUs each, real raylets) kept for all runs. For every
workload (PPO on CartPole, GraphSAGE on the generated graph, the CTR model on parameter
shards, the pipeline-parallel language model, XGBoost with its trainers on spot) and every mode, the job runs for ``--duration`` seconds of wall time:

* ``fault-free``: no preemptions.
* ``notice``: a spot node preempted every ``--every`` seconds with ``--notice`` seconds of
  notice (a Ray drain with a deadline), replaced 2 s after it is gone.
* ``no-notice``: the same times and victims, removed without notice.
* ``restart-all``: no notice, and every node loss restarts every actor of the job from the
  last checkpoint (how Ray Train and similar recover), instead of replacing what was lost.

Prints per workload and mode: driver steps completed (progress, after any rewinds),
goodput (steps per second) and its ratio to fault-free (targets: >= 0.9 with notice,
>= 0.8 without), and per loss the detection time (node removed -> the driver's first event
about it; for notice runs, notice -> NodeLeaving) and recovery time (node removed -> the end
of the first step begun after it that goes past the most progress made before it; target
<= 5 s), and the longest
stall between two steps in the run (where a restart shows), the cost per thousand steps
at the planned placement (``--stateful-market spot`` puts the stateful roles on spot
nodes too; spot CPU-hours at 0.35 of on-demand), and where each recovery restored from
(``memory``: peer replicas, ``store``: the last checkpoint) with the steps it rolled back. Writes ``spot_<workload>.png`` (steps
against time, preemptions marked) into ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder comes first on sys.path, and its xgboost.py (the XGBoost
# benchmark) would shadow the xgboost package the xgboost job imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402 - after the sys.path fix above
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from raylane.api import Driver  # noqa: E402
from raylane.prepare import build, job_config  # noqa: E402
from raylane.api import PoolError  # noqa: E402
from raylane.preemption import NodeLost  # noqa: E402
from raylane.registry import get  # noqa: E402
from raylane.testing.spotmarket import SpotMarket  # noqa: E402

SPOT = ("spot-a", "spot-b")
PRICE = {"on-demand": 1.0, "spot": 0.35}  # per CPU-hour: spot at 0.35 of on-demand

OVERRIDES = {
    "ppo": ["workers=2", "worker_cpus=1", "total_env_steps=1000000000", "target_return=null", "driver.checkpoint_every_steps=10"],
    "graphsage": ["graph.nodes=20000", "epochs=100000", "samplers=2", "sampler_cpus=1", "trainer_cpus=1", "driver.checkpoint_every_steps=5"],
    "ps_ctr": ["rows=40000", "eval_rows=4000", "workers=2", "shards=2", "shard_cpus=0.5", "worker_cpus=0.5", "mode=sync", "clocks_per_step=5",
               "target_auc=0", "driver.checkpoint_every_steps=10"],
    "pipeline_lm": ["stages=2", "stage_cpus=1", "micro_batches=4", "replace_timeout_s=10", "driver.checkpoint_every_steps=10"],
    "xgboost": ["data.source=synthetic:classification", "data.rows=100000", "data.num_features=16", "num_boost_round=1000000", "checkpoint_every=5",
                "trainers=2", "threads=1", "prefer_spot=true"],
}


class RestartAll:
    """The peers' recovery around a workload: any node loss, or any failure, closes every
    actor and builds the job again from its last checkpoint."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.lost = False
        for key in ("name", "main_metric", "guarded_metrics", "progress_metrics"):
            if hasattr(inner, key):
                setattr(self, key, getattr(inner, key))

    def __getattr__(self, key: str) -> Any:
        return getattr(self.inner, key)

    def on_event(self, event: Any) -> bool:
        self.lost = self.lost or isinstance(event, NodeLost)
        handler = getattr(self.inner, "on_event", None)
        return bool(handler(event)) if handler else False

    def step(self, step: int) -> dict[str, Any]:
        if self.lost:
            self.lost = False
            raise PoolError("a node was lost: restarting every actor from the last checkpoint")
        return self.inner.step(step)

    def recover(self, ctx: Any, error: BaseException) -> None:
        ctx.groups.shutdown()
        self.inner.close()
        self.inner.setup(ctx)


def restore(market: SpotMarket) -> None:
    market.refill(dict.fromkeys(SPOT, 1.0))


def play(market: SpotMarket, mode: str, every: float, notice: float, duration: float, seed: int, t0: float, stop: threading.Event) -> threading.Thread:
    """Preempt a spot node every ``every`` s (victims from ``seed``), replace it 2 s after."""
    rng = random.Random(seed)

    def run() -> None:
        k = 1
        while not stop.is_set() and k * every < duration - 5:
            if stop.wait(max(0.0, t0 + k * every - time.time())):
                return
            wanted = SPOT[rng.randrange(len(SPOT))]
            nodes = market.spot_nodes()
            victim = next((n for n in nodes if n.name == wanted), nodes[0])
            if mode == "notice":
                market.preempt(victim, notice_s=notice)
            else:
                market.remove(victim)
            time.sleep(2.0)
            market.add_node("spot", speed=1.0, cpus=2, name=victim.name)
            k += 1

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def run_one(market: SpotMarket, job: str, mode: str, args, runs: Path) -> dict[str, Any]:
    restore(market)
    spec = get(job)
    name = f"{job}-{mode}"
    # (xgboost derives its steps from its rounds and refuses driver.max_steps)
    conf = job_config(spec, overrides=OVERRIDES[job] + ([] if job == "xgboost" else ["driver.max_steps=1000000000"]) + [
        f"driver.stateful_market={args.stateful_market}", f"driver.hot_spares={args.hot_spares}", f"driver.max_wall_s={args.duration}", "driver.progress=false", "driver.tensorboard=false",
        f"driver.runs_dir={runs}", f"driver.run_name={name}", "driver.max_failures=1000"])
    workload = build(spec, conf)
    if mode == "restart-all":
        workload = RestartAll(workload)
    market.log.clear()
    stop = threading.Event()
    t0 = time.time()
    schedule = None if mode == "fault-free" else play(market, "notice" if mode == "notice" else "remove", args.every, args.notice, args.duration, args.seed, t0, stop)
    summary = Driver(workload, conf.driver).run()
    wall = time.time() - t0
    stop.set()
    if schedule is not None:
        schedule.join(timeout=120)
    rows = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (runs / name / "events.jsonl").read_text().splitlines()]
    losses = [t for t, kind, _ in market.log if kind == "removed"]
    notices = [t for t, kind, _ in market.log if kind == "notice"]
    detect = []
    for t in losses:
        seen = [e["time"] for e in events if e["time"] >= t and e["event"] in ("NodeLost", "failure")]
        if seen:
            detect.append(seen[0] - t)
    recover = recovery_times(rows, events, losses)
    notice_seen = []
    for t in notices:
        seen = [e["time"] for e in events if e["time"] >= t and e["event"] == "NodeLeaving"]
        if seen:
            notice_seen.append(seen[0] - t)
    times = [r["time"] for r in rows]
    stall = max((b - a for a, b in zip(times, times[1:])), default=0.0)  # the longest wait between two steps
    plan = next(e for e in events if e["event"] == "plan")["assignments"]
    price = sum(a["resources"].get("CPU", 0.0) * PRICE[a["market"]] for a in plan)  # per hour, as planned at the start
    for e in events:  # hot spares reserve their role's CPUs too, on the markets they were started on
        for kept in (e.get("roles") or {}).values() if e["event"] == "hot_spares" else ():
            price += sum(kept["resources"].get("CPU", 0.0) * PRICE[market] for market in kept["markets"])
    restored = [e for e in events if e["event"] == "restored"]
    return {"job": job, "mode": mode, "steps": summary["steps"], "price_per_h": price, "restored": [(e["source"], e["steps_rolled_back"]) for e in restored],
            "restore_parts": {k: [e[k] for e in restored if k in e] for k in ("reform_s", "find_s", "load_s")}, "stall": stall, "wall": wall, "state": summary["state"], "recoveries": summary["failures_recovered"],
            "losses": len(losses), "detect": detect, "notice_seen": notice_seen, "recover": recover,
            "curve": [(r["time"] - t0, r["step"]) for r in rows], "marks": [t - t0 for t in losses]}


def recovery_times(rows: list[dict], events: list[dict], losses: list[float]) -> list[float]:
    """Per loss: seconds from the node's removal to the end of the first step that started
    after it, went past the most progress made before it, and was kept (no rewind below that
    progress before the next loss). A step's start is the end of the step before it, or the
    driver's last return to RUNNING (after a recovery), whichever is later; so a step under
    way at the loss, a replayed step, and steps later thrown away by a restart do not count."""
    resumed = sorted(e["time"] for e in events if e["event"] == "state" and e.get("state") == "running")
    out = []
    for k, t in enumerate(losses):
        until = losses[k + 1] if k + 1 < len(losses) else float("inf")
        reached = max([r["step"] for r in rows if r["time"] <= t], default=0)
        for i, r in enumerate(rows):
            start = max([rows[i - 1]["time"] if i else 0.0] + [x for x in resumed if x <= r["time"]])
            if r["time"] <= t or start < t or r["step"] <= reached:
                continue
            if all(q["step"] > reached for q in rows[i + 1 :] if q["time"] < until):
                out.append(r["time"] - t)
                break
        else:
            out.append(float("inf"))  # no new progress kept before the next loss or the end
    return out


def plot(job: str, results: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(xs, ys, label=f"{r['mode']} ({r['steps']} steps)")
    marks = next((r["marks"] for r in results if r["mode"] == "no-notice"), [])
    for m in marks:
        ax.axvline(m, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("driver step (progress)")
    ax.set_title(f"{job}: progress under spot preemptions (dotted: a spot node gone)")
    ax.legend()
    path = out / f"spot_{job}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fmt(xs: list[float]) -> str:
    return "-" if not xs else f"median {statistics.median(xs):.1f} s, max {max(xs):.1f} s ({len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["ppo", "graphsage", "xgboost"], choices=sorted(OVERRIDES))
    ap.add_argument("--every", type=float, default=60.0, help="seconds between preemptions")
    ap.add_argument("--notice", type=float, default=30.0, help="seconds of notice in the notice mode")
    ap.add_argument("--duration", type=float, default=240.0, help="wall seconds per run")
    ap.add_argument("--modes", nargs="+", default=["fault-free", "notice", "no-notice", "restart-all"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stateful-market", default="on-demand", choices=["on-demand", "spot", "any"],
                    help="driver.stateful_market: where the stateful roles (shards, learners, trainers) go")
    ap.add_argument("--hot-spares", type=int, default=0, help="driver.hot_spares: started spare actors per stateful gang")
    ap.add_argument("--out", default=".", help="folder for the PNG plots")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="spot-bench-"))
    import ray

    market = SpotMarket(head_cpus=2)
    try:
        ray.init(address=market.address, log_to_driver=False)
        for name in SPOT:
            market.add_node("spot", speed=1.0, cpus=2, name=name)
        print(f"preemptions every {args.every:g} s ({args.notice:g} s notice in notice mode), {args.duration:g} s per run, "
              f"stateful roles on {args.stateful_market}, {args.hot_spares} hot spare(s) per stateful gang; price per CPU-hour: on-demand 1, spot {PRICE['spot']}")
        for job in args.workloads:
            results = [run_one(market, job, mode, args, runs) for mode in args.modes]
            base = next((r for r in results if r["mode"] == "fault-free"), None)
            print(f"\n== {job}")
            print(f"{'mode':<12}{'steps':>7}{'steps/s':>9}{'ratio':>7}{'cost/kstep':>11}  losses  recoveries  stall  detection            recovery (node gone -> new progress)  restored from (steps back)")
            for r in results:
                rate = r["steps"] / r["wall"]
                ratio = f"{rate / (base['steps'] / base['wall']):.2f}" if base and base["steps"] else "-"
                cost = r["price_per_h"] / 3600 / rate * 1000 if rate else float("inf")
                det = fmt(r["notice_seen"]) + " notice" if r["mode"] == "notice" else fmt(r["detect"])
                back = ", ".join(f"{src} ({n})" for src, n in r["restored"]) or "-"
                print(f"{r['mode']:<12}{r['steps']:>7}{rate:>9.2f}{ratio:>7}{cost:>11.4f}  {r['losses']:>6}  {r['recoveries']:>10}  {r['stall']:4.1f}s  {det:<20} {fmt(r['recover']):<37} {back}")
            for r in results:
                if any(r["restore_parts"].values()):
                    print(f"  {r['mode']}: restores' seconds (median, max): " + ", ".join(
                        f"{k[:-2]} {statistics.median(v):.2f}/{max(v):.2f}" for k, v in r["restore_parts"].items() if v))
            print(f"plot: {plot(job, results, out)}", flush=True)
            (out / f"spot_{job}.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in results], indent=1))
    finally:
        ray.shutdown()
        market.shutdown()


if __name__ == "__main__":
    main()
