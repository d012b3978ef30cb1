"""Config input hardening: safe YAML (duplicate keys, YAML 1.1 numbers, aliases, unreadable
files), finite floats, and cross-field rules checked before Ray starts."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pytest

from raylane import config as config_module
from raylane.config import ConfigError, field, from_dict, load_config, parse_override, read_mapping, validate
from raylane.jobs.linreg import LinRegConfig
from raylane.jobs.ppo import PPOConfig
from raylane.workload import DriverConfig

from prepared import config  # tests/prepared.py

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Nine levels of nine aliases each: ~400 bytes that expand to ~4*10**8 nodes.
BILLION_LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@dataclass
class Floats:
    lr: float = field(0.1, gt=0)
    """A bounded float."""
    target: float | None = None
    """An optional float."""
    weights: list[float] = field([1.0, 2.0])
    """Floats in a list."""


def _write(tmp_path, text: str | bytes, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ----------------------------------------------------------------------------- YAML


def test_duplicate_key_in_a_config_file_is_refused_with_its_dotted_key_and_line(tmp_path) -> None:
    path = _write(tmp_path, "workers: 2\nsampler:\n  batch: 64\n  fanouts: [5]\n  batch: 128\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'sampler\.batch' at line 5 \(first given at line 3\)") as err:
        read_mapping(path)
    assert path in str(err.value)


def test_duplicate_key_in_an_override_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"bad override .*duplicate key 'b'"):
        parse_override("a={b: 1, b: 2}")
    with pytest.raises(ConfigError, match=r"duplicate key 'x'"):
        parse_override("a={x: 10, x: 010}")  # one key twice, however the number is spelt


def test_leading_zero_integers_are_decimal_and_0o_is_octal(tmp_path) -> None:
    assert parse_override("workers=010") == ("workers", 10)
    assert parse_override("seed=-007") == ("seed", -7)
    assert parse_override("mode=0o10") == ("mode", 8)  # explicit YAML 1.2 octal stays octal
    assert parse_override("mask=0x1f") == ("mask", 31)
    assert read_mapping(_write(tmp_path, "workers: 010\nsteps: 1_000\n")) == {"workers": 10, "steps": 1000}


def test_sexagesimal_numbers_stay_strings(tmp_path) -> None:
    assert parse_override("t=1:30") == ("t", "1:30")
    assert parse_override("t=1:30.5") == ("t", "1:30.5")
    assert read_mapping(_write(tmp_path, "t: 12:30:45\nx: 1.5\ny: .inf\n")) == {"t": "12:30:45", "x": 1.5, "y": float("inf")}


def test_billion_laughs_is_refused_quickly_while_small_aliases_still_load(tmp_path) -> None:
    small = "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\nd: *b\n"
    assert read_mapping(_write(tmp_path, small, "small.yaml")) == {"base": {"x": 1, "y": 2}, "c": {"x": 1, "y": 3}, "d": {"x": 1, "y": 2}}
    assert len(BILLION_LAUGHS) < 500
    path = _write(tmp_path, BILLION_LAUGHS)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"aliases expand past the bound") as err:
        read_mapping(path)
    assert time.monotonic() - start < 0.5
    assert path in str(err.value)
    with pytest.raises(ConfigError, match=r"bad override .*aliases expand past the bound"):
        parse_override("x={" + BILLION_LAUGHS.strip().replace("\n", ", ") + "}")


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"alias refers to a collection that contains it"):
        parse_override("x=&a [1, *a]")


def test_the_loader_leaves_yaml_safeloader_alone() -> None:
    import yaml

    assert config_module.ConfigLoader.yaml_implicit_resolvers is not yaml.SafeLoader.yaml_implicit_resolvers
    assert yaml.safe_load("a: 010") == {"a": 8}  # PyYAML's own reading, for other users in the process


def test_a_config_path_that_is_a_folder_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match=rf"config file {tmp_path}: is a folder"):
        read_mapping(str(tmp_path))


def test_a_binary_config_file_is_refused_naming_it(tmp_path) -> None:
    path = _write(tmp_path, b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary", "model.bin")
    with pytest.raises(ConfigError, match=rf"config file {path}: not UTF-8 text"):
        read_mapping(path)


def test_an_unreadable_config_file_is_refused_naming_it(tmp_path, monkeypatch) -> None:
    path = _write(tmp_path, "workers: 2\n")

    def forbidden(*args, **kwargs):  # root reads any file, so the error is injected
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(config_module, "open", forbidden, raising=False)
    with pytest.raises(ConfigError, match=rf"config file {path}: this user may not read it"):
        read_mapping(path)


# ----------------------------------------------------------------------------- finite floats


@pytest.mark.parametrize(("override", "key"), [
    ("lr=.inf", "lr"), ("lr=.nan", "lr"), ("target=-.inf", "target"), ("target=.nan", "target"),
    ("weights=[1.0, .nan]", r"weights\[1\]"),
])
def test_nan_and_infinity_are_refused_for_float_fields(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number"):
        load_config(Floats, overrides=[override])


def test_nan_passed_as_data_is_refused_and_validate_checks_it_too() -> None:
    with pytest.raises(ConfigError, match=r"^target: must be a finite number, got nan"):
        from_dict(Floats, {"target": float("nan")})
    built = Floats()
    built.lr = float("inf")
    with pytest.raises(ConfigError, match=r"^lr: must be a finite number > 0, got inf"):
        validate(built)


def test_a_field_may_opt_out_of_the_finite_check() -> None:
    @dataclass
    class Limits:
        limit: float = field(1.0, finite=False)
        """inf: no limit."""

    assert load_config(Limits, overrides=["limit=.inf"]).limit == float("inf")
    assert dataclasses.fields(Limits)[0].metadata["finite"] is False


@pytest.mark.parametrize(("override", "key"), [
    ("lr=.inf", "lr"), ("target_return=.nan", "target_return"),
    ("driver.checkpoint_every_s=.inf", r"driver\.checkpoint_every_s"),
])
def test_ppo_refuses_non_finite_values_at_config_time(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}: must be a finite number"):
        load_config(PPOConfig, overrides=[override])


def test_xgboost_refuses_a_non_finite_param() -> None:
    pytest.importorskip("xgboost")

    with pytest.raises(ConfigError, match=r"params\.eta: must be a finite number, got nan"):
        config("xgboost", "params.eta=.nan")


# ----------------------------------------------------------------------------- relations


def test_ppo_refuses_more_minibatches_than_samples_per_batch() -> None:
    figures = ["workers=1", "envs_per_worker=2", "rollout_steps=4"]
    with pytest.raises(ConfigError, match=r"minibatches \(9\) must not exceed .* workers \(1\) x envs_per_worker \(2\) "
                                          r"x rollout_steps \(4\) = 8; lower minibatches to at most 8"):
        load_config(PPOConfig, overrides=[*figures, "minibatches=9"])


def test_checkpoint_uri_with_a_scheme_pyarrow_cannot_open_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_uri='nosuchfs://b/x': pyarrow\.fs cannot open the scheme 'nosuchfs'; "
                                          r"use a local folder, file://, s3://"):
        load_config(LinRegConfig, overrides=["driver.checkpoint_uri=nosuchfs://b/x"])
    for uri in ("s3://bucket/ckpt", "gs://bucket/ckpt", "file:///tmp/ckpt", "ckpt/local"):  # no network call for s3/gs
        validate(DriverConfig(checkpoint_uri=uri))
