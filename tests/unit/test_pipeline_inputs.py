"""The pipeline job's inputs without Ray: token files (ids or UTF-8 bytes) and a model
factory of the user's own, each checked before Ray starts with what to change."""

from __future__ import annotations

import numpy as np
import pytest

from raylane import config as cfg
from raylane.jobs.pipeline_inputs import TokenData, load_tokens
from raylane.jobs.pipeline_lm import PipelineLMConfig

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def load(*overrides: str) -> PipelineLMConfig:
    return config("pipeline_lm", "model.seq_len=8", "stages=2", *overrides)


def test_npy_ids_and_utf8_text_by_bytes(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.int32) % 50)
    t = load_tokens(TokenData(path=str(tmp_path / "ids.npy")), text_chars=0, seed=0)
    assert t.kind == "npy" and t.vocab == 50 and t.ids.dtype == np.int64 and t.ids[:3].tolist() == [0, 1, 2]
    (tmp_path / "t.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    t = load_tokens(TokenData(path=str(tmp_path / "t.txt")), text_chars=0, seed=0)
    assert t.kind == "text" and t.vocab == 256 and bytes(t.ids[:6].astype(np.uint8)).decode("utf-8") == "héllo"
    assert load_tokens(TokenData(), text_chars=5000, seed=0).vocab == 96  # the generated text


@pytest.mark.parametrize("write, overrides, message", [
    (lambda p: np.save(p / "ids.npy", np.array([3, 7, 120, 5])), ["data.vocab=100"],
     r"data.vocab: token id 120 at position 2 of .*ids.npy' is beyond vocab=100 .* raise data.vocab to at least 121"),
    (lambda p: np.save(p / "ids.npy", np.array([3, -1, 5])), [], r"token id -1 at position 1 is negative"),
    (lambda p: np.save(p / "ids.npy", np.zeros((4, 4), np.int64)), [], r"holds a int64 array of shape \(4, 4\); token ids are one dimension of integers"),
    (lambda p: np.save(p / "ids.npy", np.array([{"a": 1}], dtype=object)), [], r"holds Python objects .*pickled arrays are refused"),
    (lambda p: (p / "ids.npy").write_bytes(b"\xff\xfe" * 100), ["data.format=text"], r"is not UTF-8 text \(byte 0: invalid start byte\)"),
    (lambda p: None, [], r"data.path: cannot read"),
])
def test_a_token_file_that_cannot_be_used_is_refused_naming_what_is_wrong(tmp_path, write, overrides, message):
    write(tmp_path)
    with pytest.raises(cfg.ConfigError, match=message):
        load(f"data.path={tmp_path / 'ids.npy'}", *overrides)


def test_a_users_layers_are_built_and_tried_on_a_batch(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(5000) % 40)
    conf = load("model.factory=lm_models:tiny_lm", f"data.path={tmp_path / 'ids.npy'}")
    tokens, shape, factory, n_layers = conf.inputs()
    assert n_layers == 4 and factory.spec.vocab == 40 and factory.spec.seq_len == 8
    a, b = factory.build()[0], factory.build()[0]  # every stage builds the same weights: the factory runs under one seed
    assert all(np.array_equal(x.detach().numpy(), y.detach().numpy()) for la, lb in zip(a, b) for x, y in zip(la.parameters(), lb.parameters()))
    assert a[0] is not b[0]  # fresh copies: a re-split never hands a stage another stage's trained module


@pytest.mark.parametrize("factory, message", [
    ("lm_models:not_a_list", r"model factory 'lm_models:not_a_list' returned Linear; it must return \(layers, loss\)"),
    ("lm_models:mismatched", r"layer 1 \(Linear\) failed on the previous layer output: RuntimeError"),
    ("lm_models:vector_loss", r"loss returned a tensor of shape \(2, 8\); it must be a finite scalar tensor"),
    ("lm_models:nope", r"module 'lm_models' has no 'nope'"),
    ("no_such_pkg.models:lm", r"importing module 'no_such_pkg.models' failed: ModuleNotFoundError"),
])
def test_a_factory_that_does_not_build_a_usable_model_is_refused(factory, message):
    with pytest.raises(cfg.ConfigError, match=message):
        load(f"model.factory={factory}")


def test_the_builtin_models_shape_keys_and_too_many_stages_are_refused_with_a_factory():
    with pytest.raises(cfg.ConfigError, match=r"factory='lm_models:tiny_lm' builds the whole model, so d_model, n_blocks would be ignored"):
        load("model.factory=lm_models:tiny_lm", "model.d_model=64", "model.n_blocks=8")
    with pytest.raises(cfg.ConfigError, match=r"stages x chunks = 5 x 1 = 5 pieces but model 'lm_models:tiny_lm' has 4; use fewer stages or chunks"):
        load("model.factory=lm_models:tiny_lm", "stages=5", "micro_batches=8")
