"""A trained model out of a run, in its field's usual form, and back in without Ray.

``export_run(run_dir)`` reads the run's newest checkpoint (or, with ``best``, the one
``driver.keep_best`` kept), every part checked against its manifest, and lets the job write
its model into a folder (``<run>/export/``, ``<run>/export-best/``, or one given): an
XGBoost ``model.ubj``, a torch ``state_dict`` file with the JSON needed to rebuild the
module, whatever the job's own ``JobSpec.export`` writes. ``export.json``, written last,
names the job, the run, the step and the sha256 of every file.

``load_model(path)`` checks every file against ``export.json`` (a mismatch is refused) and
hands the folder to the job's ``JobSpec.load_model``, which returns a ready object (a torch
module in eval mode, an ``xgboost.Booster``). Nothing is unpickled: tensors load with
``torch.load(weights_only=True)``, the rest is JSON and the field's own formats.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from raylane import config as cfg
from raylane.best_store import beside
from raylane.checkpoint import CheckpointStore
from raylane.checkpoint_format import CheckpointError
from raylane.runrecord import RECORD

MANIFEST = "export.json"
VERSION = 1


class ExportError(ValueError):
    """A run that cannot be exported, or an export that does not load; the message names it."""


def _record(run_dir: Path) -> tuple[Any, Any]:
    """(the job's spec, the config the run started with), from the run's record; (None, None)
    for a run folder without one (a run driven from Python: its checkpoints name the job)."""
    from raylane import prepare, registry

    path = run_dir / RECORD
    if not path.exists():
        if (run_dir / "checkpoints").is_dir() or (run_dir / "summary.json").exists():
            return None, None
        raise ExportError(f"{run_dir} is not a run folder (no {RECORD}); give the folder of a run (runs/NAME) or of an export")
    try:
        record = json.loads(path.read_text())
        spec = registry.get(record["job"])
        return spec, prepare.job_config(spec, record["config"])
    except (OSError, ValueError, KeyError, TypeError, cfg.ConfigError) as exc:
        raise ExportError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _has_export(spec: Any) -> None:
    from raylane import registry

    if spec.export is None:
        can = sorted(n for n, s in registry.available().items() if s.export is not None)
        raise ExportError(f"job {spec.name!r} has no export; these jobs have one: {', '.join(can)}")


def export_run(run_dir: str | Path, *, best: bool = False, out: str | Path | None = None) -> Path:
    """Write the model of the run in ``run_dir`` (its newest checkpoint, or with ``best`` the
    one kept by ``driver.keep_best``) into ``out`` (default ``<run>/export`` or
    ``<run>/export-best``), replacing what was there; returns the folder."""
    from raylane import registry

    run_dir = Path(run_dir)
    spec, conf = _record(run_dir)
    if spec is not None:
        _has_export(spec)
    uri = conf.driver.store_uri(run_dir) if conf is not None else str(run_dir / "checkpoints")
    where = beside(uri, "best") if best else uri
    try:
        absent = "://" not in where and not Path(where).is_dir()  # a local store is not made to be looked into
        store = None if absent else CheckpointStore(where)
        if store is None or not store.steps():
            raise ExportError(f"run {run_dir.name!r} has no {'best ' if best else ''}checkpoint in {where}"
                              + ("; run it with --set driver.keep_best=true, or export its newest checkpoint without --best" if best else ""))
        step, state = store.load_whole()
    except CheckpointError as exc:
        raise ExportError(f"run {run_dir.name!r}: {exc}") from None
    if spec is None:  # no record: the checkpoint names its job (those written before it did cannot be exported this way)
        try:
            spec = registry.get(state["driver"]["job"])
        except (KeyError, registry.UnknownJobError):
            raise ExportError(f"{run_dir}: no {RECORD} and its checkpoint does not name a registered job; "
                              "export a run started with `raylane run` or raylane.api.run") from None
    _has_export(spec)
    folder = Path(out) if out is not None else run_dir / ("export-best" if best else "export")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = spec.export(conf, state["workload"], tmp)
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"version": VERSION, "job": spec.name, "run": run_dir.name, "step": step, "best": best,
                "metric": (state.get("driver", {}).get("best") if best else None), "created": time.time(), "files": files, "model": model}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def read_export(folder: str | Path) -> dict[str, Any]:
    """``export.json`` of ``folder``, every file it lists checked by size and sha256."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{folder} holds no readable {MANIFEST} ({type(exc).__name__}: {exc}); export the run first (raylane export RUN)") from None
    if manifest.get("version") != VERSION:
        raise ExportError(f"{folder / MANIFEST}: version {manifest.get('version')!r}; this raylane reads version {VERSION}")
    for name, entry in files.items():
        path = folder / name
        if "/" in name or "\\" in name or not path.is_file():
            raise ExportError(f"{folder}: {name} is missing; export the run again")
        if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
            raise ExportError(f"{folder}: {name} does not match {MANIFEST} (size or sha256): altered or torn; it was not loaded - export the run again")
    return manifest


def load_model(path: str | Path, *, best: bool = False) -> Any:
    """The trained model of an export folder, or of a run folder (exported first, into
    ``<run>/export`` or with ``best`` ``<run>/export-best``): what the job's
    ``JobSpec.load_model`` builds, ready to predict without Ray."""
    from raylane import registry

    path = Path(path)
    if not (path / MANIFEST).exists():
        path = export_run(path, best=best)
    manifest = read_export(path)
    spec = registry.get(manifest["job"])
    if spec.load_model is None:
        raise ExportError(f"job {spec.name!r} has no loader for its export")
    return spec.load_model(path, manifest)
