"""raylane export and load_model on what they refuse (no Ray needed): a folder that is no run,
a run without a checkpoint, a job without an export, an export whose files were altered."""

from __future__ import annotations

import json

import pytest

from raylane import prepare, registry, runrecord
from raylane.export import ExportError, export_run, load_model, read_export

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def a_run(tmp_path, job, name="r"):
    spec = registry.get(job)
    conf = prepare.job_config(spec, overrides=[f"driver.runs_dir={tmp_path}", f"driver.run_name={name}"])
    runrecord.write_record(spec.name, conf, tmp_path / name)
    return tmp_path / name


def test_a_run_without_a_checkpoint_is_one_line_naming_the_run(tmp_path):
    run = a_run(tmp_path, "xgboost", "fresh")
    with pytest.raises(ExportError, match=r"run 'fresh' has no checkpoint in .*fresh/checkpoints$"):
        export_run(run)
    with pytest.raises(ExportError, match=r"run 'fresh' has no best checkpoint in .*checkpoints/best; run it with --set driver.keep_best=true"):
        export_run(run, best=True)


def test_a_job_without_an_export_and_a_folder_that_is_no_run_are_refused(tmp_path):
    job = tmp_path / "my_job.py"
    job.write_text("from raylane.api import JobSpec\nfrom raylane.jobs.linreg import LinRegConfig, LinRegWorkload\n"
                   "JOB = JobSpec('mine', 'a job of your own, without an export', LinRegConfig, LinRegWorkload)\n")
    run = tmp_path / "mine"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"job": f"{job}:JOB", "config": {}}))
    with pytest.raises(ExportError, match=r"job 'mine' has no export; these jobs have one: .*ps_ctr.*xgboost"):
        export_run(run)
    with pytest.raises(ExportError, match=r"is not a run folder \(no config.json\)"):
        load_model(tmp_path / "nothing")


def test_an_export_whose_file_does_not_match_its_manifest_is_refused(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.ubj").write_bytes(b"trees")
    import hashlib

    entry = {"size": 5, "sha256": hashlib.sha256(b"trees").hexdigest()}
    (folder / "export.json").write_text(json.dumps({"version": 1, "job": "xgboost", "files": {"model.ubj": entry}, "model": {}}))
    assert read_export(folder)["job"] == "xgboost"
    (folder / "model.ubj").write_bytes(b"TREES")
    with pytest.raises(ExportError, match=r"model.ubj does not match export.json \(size or sha256\): altered or torn; it was not loaded"):
        load_model(folder)
    (folder / "model.ubj").unlink()
    with pytest.raises(ExportError, match=r"model.ubj is missing"):
        read_export(folder)


def test_an_export_never_imports_a_job_by_path_and_imports_a_users_code_only_when_trusted(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "evil.py").write_text("raise SystemExit('ran')\n")
    import hashlib

    files = {"evil.py": {"size": (folder / "evil.py").stat().st_size, "sha256": hashlib.sha256((folder / "evil.py").read_bytes()).hexdigest()}}
    for job, model, message in ((f"{folder}/evil.py:JOB", {}, r"job '.*evil.py:JOB' is not a job with an export in this raylane"),
                                ("ppo", {"imports": [f"{folder}/evil.py:F"]}, r"rebuilt by importing .*evil.py:F, which runs that code; pass trust_code=True")):
        (folder / "export.json").write_text(json.dumps({"version": 1, "job": job, "files": files, "model": model}))
        with pytest.raises(ExportError, match=message):
            load_model(folder)


def test_out_never_replaces_a_folder_that_is_not_an_export(tmp_path):
    run = a_run(tmp_path, "xgboost", "r")
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "other.ubj").write_bytes(b"keep me")
    for out, message in ((mine, r"it exists and is not an earlier export"), (tmp_path, r"it holds the run 'r' itself"), (run, r"it holds the run 'r' itself")):
        with pytest.raises(ExportError, match=message):
            from raylane.export import _target

            _target(run, out, best=False)
    assert (mine / "other.ubj").read_bytes() == b"keep me"
