"""pipeline_lm without Ray: the generated text, the batches, the layout of stages over
live actors, and every bad input refused before anything starts."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from typer.testing import CliRunner

from raylane import config as cfg
from raylane.actors import corpus
from raylane.cli import app
from raylane.jobs.pipeline_lm import PipelineLMConfig, fit_schedule, make_layout

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_generated_text_is_seeded_learnable_and_round_trips():
    a, b, c = corpus.generate(5000, 1), corpus.generate(5000, 1), corpus.generate(5000, 2)
    assert a == b and a != c and len(a) >= 5000
    tokens = corpus.encode(a)
    assert tokens.min() >= 0 and tokens.max() < corpus.VOCAB
    assert corpus.decode(tokens) == a
    # agreement is there to be learnt: a plural subject never takes the singular verb
    assert "the birds sees" not in a and "the cat see " not in a
    assert any(f"{x} + {y} = {x + y}." in a for x in range(50) for y in range(50))


def test_text_outside_the_vocabulary_is_refused_with_its_position():
    with pytest.raises(ValueError, match=r"character '\\t' at 3 is outside the vocabulary"):
        corpus.encode("abc\tdef")
    with pytest.raises(ValueError):
        corpus.encode("caf\u00e9")


def test_batches_depend_only_on_seed_step_and_replica():
    tokens = corpus.encode(corpus.generate(20_000, 0))
    x, y = corpus.batch(tokens, 4, 3, 16, seed=7, step=5, replica=1)
    assert x.shape == y.shape == (4, 3, 16) and x.dtype == np.int64
    assert np.array_equal(x[..., 1:], y[..., :-1])  # targets are the next tokens
    x2, _ = corpus.batch(tokens, 4, 3, 16, seed=7, step=5, replica=1)
    assert np.array_equal(x, x2)
    assert not np.array_equal(x, corpus.batch(tokens, 4, 3, 16, seed=7, step=6, replica=1)[0])
    assert not np.array_equal(x, corpus.batch(tokens, 4, 3, 16, seed=7, step=5, replica=0)[0])
    train, val = corpus.split(tokens, 0.1)
    assert len(train) + len(val) == len(tokens) and abs(len(val) - 0.1 * len(tokens)) <= 1
    ex, ey = corpus.eval_windows(val, 16, limit=1000)
    assert ex.shape[1] == 16 and np.array_equal(ex[1:, 0], ey[:-1, -1])
    with pytest.raises(ValueError, match="too few for windows of seq_len=64"):
        corpus.batch(tokens[:50], 1, 1, 64, seed=0, step=0)


def test_fit_schedule_takes_the_most_stages_the_schedule_accepts():
    assert fit_schedule("interleaved", 4, 8, 2).p == 4
    assert fit_schedule("interleaved", 3, 8, 2).p == 2  # 8 micro-batches are not a multiple of 3
    assert fit_schedule("1f1b", 3, 8, 1).p == 3
    with pytest.raises(ValueError, match="unknown schedule"):
        fit_schedule("zigzag", 2, 4, 1)


def test_layout_deals_fast_actors_first_and_gives_replicas_the_same_layers():
    actors = ["a", "b", "c", "d"]
    speeds = [1.0, 2.0, 1.0, 2.0]
    lay = make_layout("1f1b", 4, 1, 2, actors, speeds, [1.0] * 6, 2)
    assert lay.sched.p == 2 and len(lay.pipelines) == 2
    assert lay.pipelines == (("b", "a"), ("d", "c"))  # stage 0 of both replicas on the fast nodes
    assert lay.speeds == (2.0, 1.0)
    assert lay.pieces == ({0: [0, 1, 2, 3]}, {1: [4, 5]})  # twice the layers on the stage twice as fast


def test_layout_over_fewer_live_actors_uses_fewer_stages():
    lay = make_layout("gpipe", 4, 1, 1, ["a", "b"], [1.0, 1.0], [1.0] * 6, 4)
    assert lay.sched.p == 2 and sorted(i for piece in lay.pieces for ids in piece.values() for i in ids) == list(range(6))
    lay = make_layout("interleaved", 4, 2, 1, ["a", "b", "c"], [1.0] * 3, [1.0] * 8, 4)
    assert lay.sched.p == 2 and len(lay.pieces[0]) == 2  # 3 stages do not divide 4 micro-batches
    with pytest.raises(ValueError, match="1 live stage actor.*cannot make 2 pipeline"):
        make_layout("gpipe", 4, 1, 2, ["a"], [1.0], [1.0] * 6, 2)


def test_layout_weighs_layers_by_measured_cost():
    costs = [0.1, 1.0, 1.0, 1.0, 1.0, 0.9]
    lay = make_layout("gpipe", 2, 1, 1, ["a", "b"], [1.0, 1.0], costs, 2)
    loads = lay.loads
    assert max(loads) <= 3.0 and abs(loads[0] - loads[1]) <= 1.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stages=0"], "stages: must be >= 1, got 0"),
        (["stages=5"], "stages x chunks = 5 x 1 = 5 pieces but the model has only 4 layers"),
        (["schedule=interleaved", "chunks=2", "stages=2", "model.n_blocks=1"], "2 x 2 = 4 pieces but the model has only 3 layers"),
        (["schedule=zigzag"], "zigzag"),
        (["schedule=1f1b", "stages=4", "micro_batches=2", "model.n_blocks=4"], "micro-batches m=2 < stages p=4"),
        (["schedule=1f1b", "chunks=2"], "chunks v=2 applies only to the looped schedules"),
        (["schedule=interleaved", "chunks=2", "micro_batches=3"], "m=3 must be a multiple of stages p=2"),
        (["model.n_heads=3"], "n_heads=3 does not divide d_model=128"),
        (["replicas=0"], "replicas: must be >= 1, got 0"),
        (["dispatch=carrier-pigeon"], "dispatch"),
    ],
)
def test_bad_configs_are_refused_naming_the_value(overrides, message):
    if overrides == ["stages=5"]:
        overrides = overrides + ["model.n_blocks=2", "micro_batches=8"]  # a schedule that holds: the layers are what is refused
    with pytest.raises(cfg.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config("pipeline_lm", *overrides)


def test_cli_refuses_bad_input_before_ray_starts_and_documents_every_key():
    runner = CliRunner()
    result = runner.invoke(app, ["run", "pipeline_lm", "--set", "schedule=1fb1"])
    assert result.exit_code == 2 and "1fb1" in result.output
    assert not ray.is_initialized()
    keys = cfg.describe(PipelineLMConfig)
    assert {"stages", "schedule", "chunks", "micro_batches", "replicas", "model.n_blocks"} <= {k for k, *_ in keys}
    assert all(doc for *_, doc in keys), [k for k, *_, doc in keys if not doc]
