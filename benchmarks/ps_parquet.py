"""ps_ctr on a Parquet click table against the same clicks generated in memory.

Two figures, each printed with the ratio Parquet / generated:
- reading: rows/s of one worker's share (``read_ctr_rows``: Parquet row groups, hashing
  the string ids) against ``ctr.rows`` (generated from the seed);
- training: rows/s of a ps_ctr run (2 workers, 2 shards, sync) on each, in one local Ray.

    python benchmarks/ps_parquet.py [--rows 200000] [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ctr_tables import write_clicks  # noqa: E402 - the tests' writer of a click table

FIELDS, NUMERIC = 4, 3


def reading(folder: Path, rows: int) -> tuple[float, float]:
    from raylane.actors import ctr
    from raylane.actors.ctr_files import describe_ctr, read_ctr_rows

    table = describe_ctr(str(folder), label="clicked")
    t0 = time.perf_counter()
    read_ctr_rows(table, 2_000, 0, rows)
    parquet = rows / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    ctr.rows(ctr.CTRShape(FIELDS, 1, 2_000, NUMERIC), 0, 0, rows)
    return parquet, rows / (time.perf_counter() - t0)


def training(folder: Path, rows: int, steps: int, runs: str) -> tuple[float, float]:
    from raylane.api import run

    common = ["workers=2", "shards=2", "buckets=2000", "eval_rows=5000", "clocks_per_step=20", f"driver.max_steps={steps}",
              "driver.progress=false", "driver.tensorboard=false", f"driver.runs_dir={runs}"]
    out = []
    for name, extra in (("parquet", [f"data.path={folder}", "data.label=clicked"]),
                        ("generated", [f"fields={FIELDS}", "ids_per_field=1", f"dense_features={NUMERIC}", f"rows={rows - 5000}"])):
        t0 = time.perf_counter()
        summary = run("ps_ctr", overrides=common + extra, run_name=name)
        wall = time.perf_counter() - t0
        assert summary["state"] == "finished", summary
        trained = steps * 20 * 2 * 512  # clocks x workers x batch rows
        out.append(trained / wall)
        print(f"  {name}: {wall:.1f} s for {steps} steps, auc {summary['final_metrics']['auc']:.3f}")
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_clicks(Path(tmp) / "clicks", args.rows, fields=FIELDS, numeric=NUMERIC, files=4)
        p, g = reading(folder, args.rows)
        print(f"reading {args.rows:,} rows: Parquet {p:,.0f} rows/s, generated {g:,.0f} rows/s; Parquet / generated = {p / g:.2f}")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        p, g = training(folder, args.rows, args.steps, str(Path(tmp) / "runs"))
        print(f"training (start-up included): Parquet {p:,.0f} rows/s, generated {g:,.0f} rows/s; Parquet / generated = {p / g:.2f}")
        ray.shutdown()


if __name__ == "__main__":
    main()
