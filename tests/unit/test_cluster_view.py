"""raylane.cluster: ClusterView validation and the pure accessors (never calls from_ray)."""

from __future__ import annotations

import json

import pytest

from raylane.cluster import ClusterError, ClusterView, NodeInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def n(node_id, **kw) -> NodeInfo:
    return NodeInfo(node_id=node_id, **kw)


def test_cluster_error_is_value_error():
    assert issubclass(ClusterError, ValueError)


def test_duplicate_ids():
    with pytest.raises(ClusterError) as e:
        ClusterView((n("aa11"), n("bb22"), n("aa11")))
    assert "duplicate node ids" in str(e.value)
    assert "['aa11', 'bb22', 'aa11']" in str(e.value)


def test_bad_market():
    with pytest.raises(ClusterError) as e:
        ClusterView((n("ok1"), n("node7", market="preemptible")))
    msg = str(e.value)
    assert msg.startswith("node node7: ")
    assert "market='preemptible'" in msg
    assert "'spot', 'on-demand'" in msg


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(cpus=-2.0), "cpus=-2.0, gpus=0.0, memory=0.0 (must be >= 0)"),
        (dict(gpus=-1.0), "cpus=1.0, gpus=-1.0, memory=0.0"),
        (dict(memory=-5.0), "memory=-5.0"),
    ],
)
def test_negative_amounts(kw, fragment):
    with pytest.raises(ClusterError) as e:
        ClusterView((n("node3", **kw),))
    msg = str(e.value)
    assert msg.startswith("node node3: ")
    assert fragment in msg


@pytest.mark.parametrize("speed, text", [(0.0, "speed=0.0"), (float("nan"), "speed=nan"), (-1.5, "speed=-1.5"), (float("inf"), "speed=inf")])
def test_bad_speed(speed, text):
    with pytest.raises(ClusterError) as e:
        ClusterView((n("fast1", speed=speed),))
    msg = str(e.value)
    assert msg.startswith("node fast1: ")
    assert text in msg
    assert "raylane.io/speed" in msg


def test_all_problems_of_a_node_in_one_message():
    with pytest.raises(ClusterError) as e:
        ClusterView((n("bad", market="x", cpus=-1.0, speed=0.0),))
    msg = str(e.value)
    assert "); cpus=-1.0, gpus=0.0, memory=0.0 (must be >= 0); speed=0.0 (" in msg
    assert msg.startswith("node bad: market='x'")


def test_valid_view_builds():
    v = ClusterView((n("a", market="spot", speed=0.25), n("b")))
    assert len(v.nodes) == 2
    assert ClusterView(()).nodes == ()


def sample() -> ClusterView:
    return ClusterView(
        (
            n("head", market="on-demand", cpus=8, gpus=1, is_head=True, accelerator_type="H100", memory=1e9,
              labels={"ray.io/market-type": "on-demand"}, available={"CPU": 6.0, "GPU": 1.0}),
            n("spot1", market="spot", cpus=4, speed=2.0, speed_source="label", available={"CPU": 4.0}),
            n("spot2", market="spot", cpus=4, draining=True, drain_deadline=1700.0),
            n("spot3", market="spot", cpus=2, gpus=2, alive=False),
        ),
        taken_at=42.0,
    )


def test_usable_alive_by_market():
    v = sample()
    assert [x.node_id for x in v.usable] == ["head", "spot1"]
    assert [x.node_id for x in v.alive] == ["head", "spot1", "spot2"]
    assert [x.node_id for x in v.by_market("spot")] == ["spot1"]
    assert [x.node_id for x in v.by_market("on-demand")] == ["head"]
    assert v.by_market("reserved") == ()
    assert [x.usable for x in v.nodes] == [True, True, False, False]


def test_totals_count_alive_nodes_only():
    assert sample().totals() == {"nodes": 3, "CPU": 16.0, "GPU": 1.0}
    assert ClusterView(()).totals() == {"nodes": 0, "CPU": 0.0, "GPU": 0.0}


def test_node_lookup():
    v = sample()
    assert v.node("spot1").speed == 2.0
    with pytest.raises(KeyError, match="no node nope"):
        v.node("nope")


def test_to_json():
    v = sample()
    data = v.to_json()
    assert data["taken_at"] == 42.0
    assert [d["node_id"] for d in data["nodes"]] == ["head", "spot1", "spot2", "spot3"]
    head = data["nodes"][0]
    assert head == {
        "node_id": "head",
        "address": "127.0.0.1",
        "cpus": 8,
        "gpus": 1,
        "accelerator_type": "H100",
        "memory": 1e9,
        "market": "on-demand",
        "speed": 1.0,
        "speed_source": "default",
        "alive": True,
        "draining": False,
        "drain_deadline": None,
        "is_head": True,
        "labels": {"ray.io/market-type": "on-demand"},
        "available": {"CPU": 6.0, "GPU": 1.0},
    }
    assert data["nodes"][1]["speed_source"] == "label"
    assert data["nodes"][2]["draining"] is True and data["nodes"][2]["drain_deadline"] == 1700.0
    assert data["nodes"][3]["alive"] is False
    # JSON-serialisable and round-trips
    assert json.loads(json.dumps(data)) == data


def test_view_is_frozen():
    v = sample()
    with pytest.raises(Exception):
        v.taken_at = 1.0  # type: ignore[misc]
