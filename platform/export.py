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
import os
import shutil
import tempfile
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
    except registry.UnknownJobError:
        raise ExportError(f"run {run_dir.name!r} is of job {record['job']!r}, which is not registered here; the export of a job of your "
                          "own comes with it registered (a `raylane.jobs` entry point of your package)") from None
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
        created = store.latest().created  # type: ignore[union-attr] - it just loaded
    except CheckpointError as exc:
        raise ExportError(f"run {run_dir.name!r}: {exc}") from None
    if spec is None:  # no record: the checkpoint names its job (those written before it did cannot be exported this way)
        try:
            spec = registry.get(state["driver"]["job"])
        except (KeyError, registry.UnknownJobError):
            raise ExportError(f"{run_dir}: no {RECORD} and its checkpoint does not name a registered job; "
                              "export a run started with `raylane run` or raylane.api.run") from None
    _has_export(spec)
    folder = _target(run_dir, out, best)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))  # beside it: one rename puts it in place
    try:
        try:
            model = spec.export(conf, state["workload"], tmp)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise ExportError(f"run {run_dir.name!r}, step {step}: the {spec.name} export failed: {exc}") from None
        files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"version": VERSION, "job": spec.name, "run": run_dir.name, "step": step, "checkpoint_created": created, "best": best,
                    "metric": (state.get("driver", {}).get("best") if best else None), "created": time.time(), "files": files, "model": model}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _target(run_dir: Path, out: str | Path | None, best: bool) -> Path:
    """Where the export goes: ``out`` only when it is new, empty or an earlier export (what is
    there is replaced), never the run folder or a folder holding it."""
    folder = Path(out) if out is not None else run_dir / ("export-best" if best else "export")
    here, run = folder.resolve(), run_dir.resolve()
    if here == run or here in run.parents:
        raise ExportError(f"--out {folder}: it holds the run {run_dir.name!r} itself; give a new or empty folder")
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not (folder / MANIFEST).exists())):
        raise ExportError(f"--out {folder}: it exists and is not an earlier export (no {MANIFEST}); give a new or empty folder, "
                          "so nothing of yours is replaced")
    folder.parent.mkdir(parents=True, exist_ok=True)
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


def load_model(path: str | Path, *, best: bool = False, trust_code: bool = False) -> Any:
    """The trained model of an export folder, or of a run folder (exported into
    ``<run>/export`` or with ``best`` ``<run>/export-best`` unless an export of its newest
    checkpoint is there already): what the job's ``JobSpec.load_model`` builds, ready to
    predict without Ray. Only a job raylane registers is loaded this way: the job named in
    ``export.json`` is never imported from a path. A model of the user's own (a policy or a
    pipeline ``model.factory``) is rebuilt by importing the code the export names, which
    runs it: that takes ``trust_code=True``."""
    from raylane import registry

    path = Path(path)
    if not (path / MANIFEST).exists():
        kept = path / ("export-best" if best else "export")
        path = kept if _current(path, kept, best) else export_run(path, best=best)
    manifest = read_export(path)
    if bool(manifest.get("best")) != best and best:
        raise ExportError(f"{path} is an export of the newest checkpoint, not of the best one; export the run with --best")
    spec = registry.available().get(manifest.get("job", ""))
    if spec is None or spec.load_model is None:
        raise ExportError(f"{path}: job {manifest.get('job')!r} is not a job with an export in this raylane "
                          f"(those are: {', '.join(n for n, s in registry.available().items() if s.load_model is not None)})")
    if (code := (manifest.get("model") or {}).get("imports")) and not trust_code:
        raise ExportError(f"{path}: the model is rebuilt by importing {', '.join(code)}, which runs that code; "
                          "pass trust_code=True to load_model if it is yours (or from a source you trust)")
    return spec.load_model(path, manifest)


def _current(run_dir: Path, kept: Path, best: bool) -> bool:
    """Whether ``kept`` is an export of the run's newest (or, with ``best``, kept) checkpoint."""
    try:
        manifest = json.loads((kept / MANIFEST).read_text())
        spec, conf = _record(run_dir)
        uri = conf.driver.store_uri(run_dir) if conf is not None else str(run_dir / "checkpoints")
        store = CheckpointStore(beside(uri, "best") if best else uri)
        latest = store.latest()
    except (OSError, ValueError, KeyError, TypeError, ExportError, CheckpointError):
        return False
    return (latest is not None and manifest.get("step") == latest.step and manifest.get("checkpoint_created") == latest.created
            and bool(manifest.get("best")) == best)
