"""Which checkpoint parts a stage of a new pipeline cut reads, and the checks on them (no Ray)."""

from __future__ import annotations

import pytest

from raylane.jobs.pipeline_state import held_layers, layers_of, parts_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STATE = {"stages": {"0": "p0", "1": "p1", "2": "p2"}, "held": {"0": [0, 1], "1": [2, 3], "2": [4, 5]}}


def test_a_stage_reads_only_the_parts_holding_one_of_its_layers():
    held = held_layers(STATE, 6)
    assert parts_for(STATE, held, [0, 1, 2]) == ["p0", "p1"]  # 2 stages cut over 3 saved ones
    assert parts_for(STATE, held, [3, 4, 5]) == ["p1", "p2"]
    assert parts_for(STATE, held, [5]) == ["p2"]
    assert parts_for(STATE, held, list(range(6))) == ["p0", "p1", "p2"]  # one stage reads them all


def test_parts_that_miss_a_layer_or_disagree_with_their_lists_are_refused():
    with pytest.raises(ValueError, match=r"no state for layers \[6, 7\].*8 layers"):
        held_layers(STATE, 8)
    with pytest.raises(ValueError, match="parts .* and their layer lists .* differ"):
        held_layers({"stages": {"0": "p0"}, "held": {"0": [0], "1": [1]}}, 2)


def test_the_whole_layers_come_from_either_form_of_the_state():
    read = {"stages": {"0": {"0": "a", "1": "b"}, "1": {"2": "c"}}, "held": {"0": [0, 1], "1": [2]}}
    assert layers_of(read) == {"0": "a", "1": "b", "2": "c"}
    assert layers_of({"layers": {"0": "a"}, "last_loss": 1.0}) == {"0": "a"}  # written through the driver
    with pytest.raises(TypeError, match="load_whole"):
        layers_of(STATE)  # parts not read
