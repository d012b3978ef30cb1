"""Stateful roles on spot: ``driver.stateful_market`` and ``driver.role_markets`` set where a
role's actors go first; a role set to spot that finds no spot room is refused at the start.
Clusters are built by hand; no Ray."""

from __future__ import annotations

import pytest

from raylane import config as cfg
from raylane.cluster import ClusterView, NodeInfo
from raylane.placement import ON_DEMAND, SPOT, PlacementError, RoleSpec, plan
from raylane.role_markets import check_spot_roles
from raylane.workload import DriverConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def view(*nodes: NodeInfo) -> ClusterView:
    return ClusterView(tuple(nodes))


def node(node_id: str, market: str, speed: float = 1.0, cpus: float = 4.0) -> NodeInfo:
    return NodeInfo(node_id=node_id, market=market, speed=speed, cpus=cpus, available={"CPU": cpus})


ROLES = [RoleSpec("param_shard", count=2, stateful=True), RoleSpec("ps_worker", count=2)]


def test_the_default_keeps_state_on_demand():
    roles = DriverConfig().with_markets(ROLES)
    p = plan(roles, view(node("od", ON_DEMAND), node("sp", SPOT)))
    assert {a.market for a in p.for_role("param_shard")} == {ON_DEMAND}
    assert {a.market for a in p.for_role("ps_worker")} == {SPOT}


def test_stateful_market_spot_puts_the_state_on_spot_and_says_it_was_asked():
    roles = DriverConfig(stateful_market="spot").with_markets(ROLES)
    p = plan(roles, view(node("od", ON_DEMAND), node("sp", SPOT)))
    shards = p.for_role("param_shard")
    assert {a.market for a in shards} == {SPOT}
    assert shards[0].reason == "stateful role prefers spot (as set)"
    check_spot_roles(roles, p, view(node("od", ON_DEMAND), node("sp", SPOT)))  # no complaint


def test_any_takes_the_fastest_node_of_either_market():
    roles = DriverConfig(stateful_market="any").with_markets([RoleSpec("learner", count=1, stateful=True)])
    p = plan(roles, view(node("od", ON_DEMAND, speed=1.0), node("sp", SPOT, speed=2.0)))
    [a] = p.for_role("learner")
    assert (a.node_id, a.reason) == ("sp", "stateful role takes any market")


def test_a_role_market_overrides_the_default_for_that_role_only():
    roles = DriverConfig(role_markets={"ps_worker": "on-demand"}).with_markets(ROLES)
    assert [r.preferred_market for r in roles] == [ON_DEMAND, ON_DEMAND]
    roles = DriverConfig(stateful_market="spot", role_markets={"param_shard": "on-demand"}).with_markets(ROLES)
    assert [r.preferred_market for r in roles] == [ON_DEMAND, SPOT]


def test_a_role_market_for_a_role_the_job_lacks_is_refused_naming_its_roles():
    with pytest.raises(ValueError, match=r"role_markets names \['shard'\], which this job does not have; its roles: \['param_shard', 'ps_worker'\]"):
        DriverConfig(role_markets={"shard": "spot"}).with_markets(ROLES)


def test_spot_state_on_a_cluster_without_spot_room_is_refused_naming_what_is_missing():
    roles = DriverConfig(stateful_market="spot").with_markets(ROLES)
    cluster = view(node("od", ON_DEMAND))
    p = plan(roles, cluster)  # falls back to on-demand ...
    with pytest.raises(PlacementError, match=r"role 'param_shard' is set to spot, but no spot node has room for one actor of \{CPU=1\}: the cluster has no spot nodes.*stateful_market"):
        check_spot_roles(roles, p, cluster)  # ... which the start refuses


def test_bad_market_values_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"market must be one of auto, on-demand, any, spot, got 'cheap'"):
        RoleSpec("x", count=1, market="cheap")
    with pytest.raises(cfg.ConfigError, match=r"stateful_market.*cheap"):
        cfg.load_config(DriverConfig, overrides=["stateful_market=cheap"])
    with pytest.raises(cfg.ConfigError, match=r"role_markets.*cheap"):
        cfg.load_config(DriverConfig, overrides=["role_markets.param_shard=cheap"])
