"""The run folder's record of what it runs: the job and the config it started with.

Running a run name again resumes it; if the config given now differs from the one the
run started with, resuming would mix two runs (an old model under new settings, or a
state that no longer fits the model). That is refused, naming every key that differs,
unless the user asks for a fresh run under a new name (``--new``) or accepts the changes
(``--resume-with-changes``), which are then listed on the terminal and in events.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raylane import config as cfg

RECORD = "config.json"
# Settings of how the run is shown, not of what it computes: never a difference.
PRESENTATION = ("driver.run_name", "driver.progress", "driver.tensorboard", "driver.control", "driver.runs_dir")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every key whose value differs, presentation keys left out."""
    a, b = flatten(old), flatten(new)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if key in PRESENTATION:
            continue
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            out.append((key, None if va is missing else va, None if vb is missing else vb))
    return out


def _show(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else repr(v)


def next_free_name(runs_dir: Path, name: str) -> str:
    """``name-2``, ``name-3``, ...: the first that is not a run folder yet."""
    i = 2
    while (runs_dir / f"{name}-{i}").exists():
        i += 1
    return f"{name}-{i}"


def check_resume(job: str, conf: Any, run_dir: Path, *, accept_changes: bool = False) -> list[tuple[str, Any, Any]]:
    """Compare ``conf`` with the config ``run_dir`` started with; returns the accepted
    differences, raises :class:`ConfigError` when they are not accepted (or the run
    folder belongs to another job). A run folder without a record (a new run, or one
    from before records were kept) passes."""
    path = run_dir / RECORD
    if not path.exists():
        return []
    try:
        record = json.loads(path.read_text())
        old_job, old_conf = record["job"], record["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise cfg.ConfigError(f"{path} is unreadable ({type(exc).__name__}: {exc}); repair or delete it to resume the run, or use --new") from None
    name = run_dir.name
    if old_job != job:
        raise cfg.ConfigError(f"run {name!r} is a {old_job!r} run, not {job!r}; choose another --run-name, or --new for a fresh run under a free name")
    diff = differences(old_conf, cfg.to_dict(conf))
    if diff and not accept_changes:
        lines = "".join(f"\n  {k}: {_show(a)} (run) -> {_show(b)} (now)" for k, a, b in diff)
        raise cfg.ConfigError(
            f"run {name!r} started with another config, so running it again would not resume the same run; {len(diff)} key(s) differ:{lines}\n"
            "Use --new for a fresh run under a free name, or --resume-with-changes to continue this run with the new values "
            "(fine for stop rules, checkpoint cadence, timeouts and a lower learning rate; a change of model or data shape will not load).")
    return diff


def write_record(job: str, conf: Any, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{RECORD}.tmp"
    tmp.write_text(json.dumps({"job": job, "config": cfg.to_dict(conf)}, indent=1, default=str) + "\n")
    tmp.replace(run_dir / RECORD)


def finished_summary(run_dir: Path) -> dict | None:
    """The summary of a run that finished (``summary.json`` with state ``finished``), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("state") == "finished" else None
