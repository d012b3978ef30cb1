"""Distributed XGBoost end to end: plain xgboost, raylane and Ray Train, side by side.

Every run trains the same problem: ``--rows`` generated rows x ``--features`` (raylane's
``synthetic:classification``), ``--rounds`` rounds of depth-6 ``hist`` trees, with the
training logloss evaluated every round (``--no-eval``: none), and is scored by AUC on the same held-out rows
(the next 200,000 rows of the generator, never trained on). Wall times are end to end:
from nothing to a trained model in this process, data generation included; starting Ray
itself is not counted (it is shared by (b), (c) and (d)).

(a) ``xgboost.train`` in this process, 2 threads
(b) ``raylane run xgboost``: 2 trainers x 1 thread (each generates its own rows)
(c) ``raylane run xgboost``: 1 trainer x 2 threads
(d) Ray Train ``XGBoostTrainer``, 2 workers x 1 CPU, as its documentation shows: a Ray
    Dataset, ``get_dataset_shard(...).materialize().to_pandas()``, ``xgboost.DMatrix``,
    and ``RayTrainReportCallback``

    pip install -e ".[bench]"
    python benchmarks/xgboost.py [--rows 1000000] [--rounds 100] [--repeats 3] [--no-eval] [--skip-ray-train]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# This file is named like the library it measures: keep its folder off the import path, or
# `import xgboost` would import this script.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import ray  # noqa: E402
import xgboost as xgb  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from raylane.actors.tabular import synthetic_rows  # noqa: E402
from raylane.cluster import ClusterView  # noqa: E402
from raylane.api import Driver, DriverConfig, job_config, workload  # noqa: E402
from raylane.jobs.xgboost import DataConfig, XGBoostJobConfig  # noqa: E402
from raylane.runlog import read_jsonl  # noqa: E402

SEED = 0
HELD_OUT = 200_000
NAMES = {"a": "(a) xgboost.train, 1 process x 2 threads", "b": "(b) raylane, 2 trainers x 1 thread", "c": "(c) raylane, 1 trainer x 2 threads", "d": "(d) Ray Train XGBoostTrainer, 2 workers"}
PARAMS = {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 6, "eta": 0.3, "seed": SEED, "eval_metric": ["logloss"]}


def plain(rows: int, features: int, rounds: int, evals: bool) -> tuple[float, xgb.Booster]:
    t0 = time.perf_counter()
    x, y = synthetic_rows("classification", SEED, features, 0, rows)
    dtrain = xgb.QuantileDMatrix(x, y, nthread=2)
    booster = xgb.train({**PARAMS, "nthread": 2}, dtrain, rounds, evals=[(dtrain, "train")] if evals else [], verbose_eval=False)
    return time.perf_counter() - t0, booster


def raylane(rows: int, features: int, rounds: int, evals: bool, trainers: int, threads: int, runs_dir: str) -> tuple[float, xgb.Booster, dict]:
    wait_cpus_free()
    name = f"bench-{trainers}x{threads}-{time.time_ns()}"
    t0, started_at = time.perf_counter(), time.time()
    conf = job_config("xgboost", XGBoostJobConfig(
        data=DataConfig(source="synthetic:classification", rows=rows, num_features=features, seed=SEED, eval_fraction=0.0),
        params=dict(PARAMS),
        num_boost_round=rounds,
        trainers=trainers,
        threads=threads,
        eval_train=evals,
        driver=DriverConfig(run_name=name, runs_dir=runs_dir, progress=False),
    ))
    summary = Driver(workload("xgboost", conf), conf.driver).run()
    wall = time.perf_counter() - t0
    assert summary["state"] == "finished", summary
    run = Path(runs_dir) / name
    steps = read_jsonl(run / "metrics.jsonl")
    running = next(e["time"] for e in read_jsonl(run / "events.jsonl") if e["event"] == "state" and e["state"] == "running")
    detail = {"until_running_s": running - started_at, "build_s": steps[0]["build_s"], "boost_s": sum(s["boost_s"] for s in steps), "chunks": len(steps)}
    return wall, xgb.Booster(model_file=str(run / "model.ubj")), detail


def ray_train(rows: int, features: int, rounds: int, evals: bool, storage: str) -> tuple[float, xgb.Booster]:
    import pandas as pd
    import ray.train
    from ray.train.xgboost import RayTrainReportCallback, XGBoostTrainer

    wait_cpus_free()
    t0 = time.perf_counter()
    x, y = synthetic_rows("classification", SEED, features, 0, rows)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(features)])
    frame["label"] = y
    train_ds = ray.data.from_pandas(frame)

    def train_fn_per_worker(config: dict) -> None:
        shard = ray.train.get_dataset_shard("train").materialize().to_pandas()
        dtrain = xgb.DMatrix(shard.drop("label", axis=1), label=shard["label"])
        watch = [(dtrain, "train")] if config["evals"] else []
        xgb.train(config["params"], dtrain=dtrain, evals=watch, num_boost_round=config["rounds"], callbacks=[RayTrainReportCallback()])

    trainer = XGBoostTrainer(
        train_fn_per_worker,
        train_loop_config={"params": {**PARAMS, "nthread": 1}, "rounds": rounds, "evals": evals},
        datasets={"train": train_ds},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    result = trainer.fit()
    booster = RayTrainReportCallback.get_model(result.checkpoint)
    return time.perf_counter() - t0, booster


def wait_cpus_free(timeout_s: float = 60.0) -> None:
    """Actors of the previous run release their CPUs asynchronously."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(n.available.get("CPU", 0) == n.cpus for n in ClusterView.from_ray().usable):
            return
        time.sleep(0.2)
    raise TimeoutError("CPUs of the previous run were not released")


def start_ray() -> None:
    # 4 logical CPUs on the 2 cores: Ray Data's tasks in (d) need room beside the 2 workers.
    # Every run reserves 2 CPUs for its training, so the compute is the same 2 cores.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ClusterView.from_ray()  # measure the node's speed once, as a long-lived cluster already has


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="run every configuration this many times; the fastest counts")
    ap.add_argument("--skip-ray-train", action="store_true", help="leave out (d), e.g. without ray[train] installed")
    ap.add_argument("--no-eval", action="store_true", help="no per-round training metric in any run (pure boosting)")
    args = ap.parse_args()
    xt, yt = synthetic_rows("classification", SEED, args.features, args.rows, args.rows + HELD_OUT)
    held_out = xgb.DMatrix(xt, feature_names=[f"f{i}" for i in range(args.features)])
    with tempfile.TemporaryDirectory(prefix="raylane-bench-") as tmp:
        walls, auc, details = run_all(args, Path(tmp), held_out, yt)
    report(args, walls, auc, details)


def run_all(args: argparse.Namespace, work: Path, held_out: xgb.DMatrix, yt) -> tuple[dict, dict, dict]:
    walls: dict[str, list[float]] = {k: [] for k in NAMES}
    auc: dict[str, float] = {}
    details: dict[str, dict] = {}
    for _ in range(args.repeats):
        # (a) runs while Ray is down: a plain process pays for no Ray daemons.
        wall, booster = plain(args.rows, args.features, args.rounds, not args.no_eval)
        walls["a"].append(wall)
        auc["a"] = roc_auc_score(yt, booster.predict(held_out))
        start_ray()
        for key, (trainers, threads) in (("b", (2, 1)), ("c", (1, 2))):
            wall, booster, detail = raylane(args.rows, args.features, args.rounds, not args.no_eval, trainers, threads, str(work / "runs"))
            walls[key].append(wall)
            if wall == min(walls[key]):
                details[key] = detail
            auc[key] = roc_auc_score(yt, booster.predict(held_out))
        ray.shutdown()
    if not args.skip_ray_train:  # once: it takes minutes
        start_ray()
        wall, booster = ray_train(args.rows, args.features, args.rounds, not args.no_eval, str(work / "ray_results"))
        walls["d"].append(wall)
        auc["d"] = roc_auc_score(yt, booster.predict(held_out))
        ray.shutdown()
    return walls, auc, details


def report(args: argparse.Namespace, walls: dict, auc: dict, details: dict) -> None:
    best = {k: min(v) for k, v in walls.items() if v}
    metric = "no per-round metric" if args.no_eval else "training logloss every round"
    print(f"\n{args.rows:,} rows x {args.features} features, {args.rounds} rounds, depth 6, hist, {metric}; AUC on {HELD_OUT:,} held-out rows; best of {args.repeats}")
    print(f"{'run':<44} {'wall s':>8} {'vs (a)':>7} {'AUC':>8} {'AUC-(a)':>9}")
    for key, label in NAMES.items():
        if key in best:
            print(f"{label:<44} {best[key]:>8.2f} {best[key] / best['a']:>7.2f} {auc[key]:>8.4f} {auc[key] - auc['a']:>+9.4f}")
    ratios = {"b/a": best["b"] / best["a"], "c/a": best["c"] / best["a"]}
    if "d" in best:
        ratios.update({"b/d": best["b"] / best["d"], "c/d": best["c"] / best["d"]})
    print("ratios: " + ", ".join(f"{k}={v:.3f}" for k, v in ratios.items()))
    print("targets: b/a <= 1.25, c/a <= 1.25, |AUC - AUC(a)| <= 0.002, b/d <= 0.25 (raylane 4x faster than Ray Train)")
    for key in ("b", "c"):
        d = details[key]
        print(f"raylane {key}: {d['until_running_s']:.2f} s to start the trainers and load the shards, {d['build_s']:.2f} s to build the matrices, {d['boost_s']:.2f} s boosting ({d['chunks']} chunks), the rest: validation, Ray calls, checkpoints, model file")
    print(json.dumps({"wall_s": walls, "auc": auc}))


if __name__ == "__main__":
    main()
