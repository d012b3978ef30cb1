"""deploy/ against what raylane reads: the cluster launcher YAML against the schema Ray ships
(and Ray's own config preparation), the KubeRay manifests field by field, the Dockerfile
against the installed Ray and the package layout. No cloud, Kubernetes or Docker here."""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from raylane import registry
from raylane.cluster import MARKET_LABEL, MARKETS, SPEED_LABEL, _label_speed
from raylane.prepare import job_config as load_job_config
from raylane.security import is_loopback

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GROUPS = {"cpu-ondemand": ("on-demand", False), "gpu-ondemand": ("on-demand", True),
          "cpu-spot": ("spot", False), "gpu-spot": ("spot", True)}
SPOT_TOLERATION = "raylane.io/spot"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def check_labels(where: str, labels: dict) -> str:
    """The labels raylane reads, valid by raylane's own parsers and Ray's label syntax; returns the market."""
    from ray._private.label_utils import validate_node_label_syntax

    assert set(labels) == {MARKET_LABEL, SPEED_LABEL}, f"{where}: labels {sorted(labels)}"
    assert labels[MARKET_LABEL] in MARKETS, f"{where}: {MARKET_LABEL}={labels[MARKET_LABEL]!r}"
    speed, source = _label_speed(where, labels)
    assert source == "label" and speed > 0
    validate_node_label_syntax(labels)
    return labels[MARKET_LABEL]


# ------------------------------------------------------------------------- cluster launcher

def test_launcher_yaml_matches_the_schema_shipped_with_ray():
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(load("cluster.yaml"), schema)


def test_launcher_yaml_survives_rays_own_preparation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(load("cluster.yaml"))  # merged with Ray's AWS defaults, offline
    validate_config(prepared)
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


def test_launcher_node_types_carry_raylanes_roles():
    c = load("cluster.yaml")
    types = c["available_node_types"]
    head = types[c["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "the head does no training work"
    assert check_labels("head", head["labels"]) == "on-demand"
    assert "InstanceMarketOptions" not in head["node_config"]
    workers = {name: t for name, t in types.items() if name != c["head_node_type"]}
    assert set(workers) == set(GROUPS)
    for name, t in workers.items():
        market, gpu = GROUPS[name]
        assert check_labels(name, t["labels"]) == market
        assert (t["resources"].get("GPU", 0) >= 1) is gpu, name
        assert t["resources"]["CPU"] >= 1, name
        assert 0 <= t["min_workers"] <= t["max_workers"], name
        on_spot = t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
        assert on_spot is (market == "spot"), f"{name}: the instance market must match its {MARKET_LABEL} label"
        if gpu:
            assert t["docker"]["worker_image"].endswith("-gpu"), name
    assert sum(t["max_workers"] for t in workers.values()) <= c["max_workers"]
    assert c["docker"]["image"].endswith("-cpu")


def test_launcher_keeps_the_dashboard_on_loopback_and_the_token_on():
    c = load("cluster.yaml")
    commands = c["head_start_ray_commands"] + c["worker_start_ray_commands"]
    hosts = [m for cmd in commands for m in re.findall(r"--dashboard-host[= ](\S+)", cmd)]
    assert hosts and all(is_loopback(h) for h in hosts), hosts
    run_options = " ".join(c["docker"]["run_options"])
    assert "RAY_AUTH_MODE=token" in run_options
    token_path = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", run_options).group(1)
    assert token_path in c["file_mounts"], "the token file Ray reads must be copied to every node"


# --------------------------------------------------------------------------------- KubeRay

def test_kuberay_kinds_versions_and_token_auth():
    cluster, job = load("kuberay/raycluster.yaml"), load("kuberay/rayjob.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token"}
        assert spec["rayVersion"] == ray.__version__, "the image's Ray must be the Ray raylane runs and submits with"


def test_kuberay_dashboard_is_not_exposed_outside_the_cluster():
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        text = (DEPLOY / name).read_text()
        assert "LoadBalancer" not in text and "NodePort" not in text and "Ingress" not in text, name
    head = load("kuberay/raycluster.yaml")["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"


def test_kuberay_groups_match_what_placement_reads():
    spec = load("kuberay/raycluster.yaml")["spec"]
    head = spec["headGroupSpec"]
    assert check_labels("head", head["labels"]) == "on-demand"
    assert head["rayStartParams"]["num-cpus"] == "0", "the head does no training work"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(GROUPS)
    for name, g in groups.items():
        market, gpu = GROUPS[name]
        assert check_labels(name, g["labels"]) == market
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], name
        pod = g["template"]["spec"]
        (container,) = pod["containers"]
        limits = container["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) is gpu, name
        assert container["image"].endswith("-gpu" if gpu else "-cpu"), name
        selector = " ".join(f"{k}={v}" for k, v in pod["nodeSelector"].items()).lower()
        tolerates_spot = any(t["key"] == SPOT_TOLERATION for t in pod.get("tolerations", []))
        if market == "spot":
            assert "spot" in selector and tolerates_spot, f"{name}: a spot group selects and tolerates the spot pool"
        else:
            assert "on_demand" in selector and not tolerates_spot, f"{name}: an on-demand group stays off spot nodes"


def test_rayjob_runs_on_the_same_groups_and_its_entrypoint_is_a_valid_raylane_job():
    cluster, job = load("kuberay/raycluster.yaml"), load("kuberay/rayjob.yaml")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "-m"] and argv[2].startswith("raylane.jobs.")
    spec = registry.get(argv[2].rsplit(".", 1)[1])
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    run_name = argv[argv.index("--run-name") + 1] if "--run-name" in argv else None
    load_job_config(spec, overrides=sets, run_name=run_name)  # the same check `raylane submit` makes


# ------------------------------------------------------------------------------ Dockerfile

def test_dockerfile_builds_on_the_ray_raylane_uses_and_installs_the_package():
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=(\S+)", text, re.M).group(1)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert base == f"rayproject/ray:{ray.__version__}-{py}", base
    assert re.search(r"^FROM \$\{RAY_IMAGE\}", text, re.M)
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        assert re.search(rf"^COPY .*\b{folder} ", text, re.M), f"the package folder {folder}/ is not copied"
    assert re.search(r"pip install --no-cache-dir \. ", text)
    images = {load("cluster.yaml")["docker"]["image"]} | {
        c["image"] for g in load("kuberay/raycluster.yaml")["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]}
    version = pyproject["project"]["version"]
    assert {i.rsplit("-", 1)[0] for i in images} == {f"ghcr.io/your-org/raylane:{version}"}, "one image of this version, CPU and GPU builds"


def test_deploy_readme_says_what_was_and_was_not_verified():
    text = (DEPLOY / "README.md").read_text()
    assert "Verified here" in text and "Not verified here" in text
