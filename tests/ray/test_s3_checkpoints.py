"""Checkpoint parts in an S3-compatible object store (moto's server on 127.0.0.1, started
here), where there is no atomic rename and a listing is by prefix: the parameter shards
write their parts into the bucket themselves, a part whose upload was cut off is never
loaded (the run resumes from the checkpoint before it), and the resumed run ends exactly
as the run that kept its checkpoints on disk (sync mode)."""

from __future__ import annotations

import pytest

from raylane.driver import DriverConfig
from raylane.jobs.ps_ctr import PSCTRConfig, PSCTRWorkload
from raylane.runlog import read_jsonl

from harness import drive  # tests/harness.py

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420), pytest.mark.usefixtures("ray_local")]

STEPS = 6


@pytest.fixture(scope="module")
def bucket():
    """An S3 endpoint on loopback with an empty bucket ``ckpt``; (boto3 client, endpoint)."""
    import boto3  # with moto: the test extra
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="ckpt")
    yield client, f"127.0.0.1:{port}"
    server.stop()


def make(tmp_path, name: str, steps: int, uri: str | None = None) -> PSCTRConfig:
    conf = PSCTRConfig(rows=8_000, eval_rows=2_000, fields=3, buckets=1_000, workers=2, shards=2, batch_size=128, clocks_per_step=3,
                       shard_cpus=0.25, worker_cpus=0.5, lr=0.1, mode="sync", wait_timeout_s=20.0)
    conf.driver = DriverConfig(run_name=name, runs_dir=str(tmp_path), max_steps=steps, checkpoint_every_steps=1, progress=False, tensorboard=False,
                               checkpoint_uri=uri)
    return conf


def test_parts_in_a_bucket_resume_exactly_and_a_cut_off_upload_is_never_loaded(tmp_path, bucket):
    client, endpoint = bucket
    uri = f"s3://test:test@ckpt/runs?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    calm = drive(PSCTRWorkload(make(tmp_path, "disk", STEPS)), make(tmp_path, "disk", STEPS).driver).summary
    assert calm["state"] == "finished"

    first = drive(PSCTRWorkload(conf := make(tmp_path, "bucket", 4, uri)), conf.driver).summary
    assert first["state"] == "finished" and first["steps"] == 4
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix="runs/bucket/")["Contents"]]
    assert "runs/bucket/0000000004/MANIFEST.json" in keys
    parts = sorted(k for k in keys if k.startswith("runs/bucket/0000000004/part-"))
    assert [k.split("/")[3] for k in parts if k.endswith("state.json")] == ["part-workload.shards.0", "part-workload.shards.1"]
    # The newest checkpoint's part as an upload cut off midway would leave it: shorter.
    cut = next(k for k in parts if k.endswith("tensors.pt"))
    body = client.get_object(Bucket="ckpt", Key=cut)["Body"].read()
    client.put_object(Bucket="ckpt", Key=cut, Body=body[: len(body) // 2])

    second = drive(PSCTRWorkload(conf := make(tmp_path, "bucket", STEPS, uri)), conf.driver).summary
    assert second["state"] == "finished" and second["resumed_from"] == 3, second
    events = read_jsonl(tmp_path / "bucket" / "events.jsonl")
    assert any(e["event"] == "checkpoint_skipped" and "part-workload.shards" in e["reason"] and "truncated" in e["reason"] for e in events)
    exact = ("loss", "auc")
    assert {k: second["final_metrics"][k] for k in exact} == {k: calm["final_metrics"][k] for k in exact}
