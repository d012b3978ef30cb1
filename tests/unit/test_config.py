"""raylane.config: typed dataclass configs, YAML/--set layering, errors that name the key."""

from __future__ import annotations  # string annotations: exercises get_type_hints resolution

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal, Optional

import pytest
import yaml

from raylane.config import (
    MISSING,
    ConfigError,
    describe,
    field,
    field_docs,
    from_dict,
    load_config,
    parse_override,
    to_dict,
    validate,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@dataclass
class Sampler:
    fanouts: list[int] = field([10, 5], ge=1)
    """Neighbours sampled per hop."""
    batch: int = field(512, gt=0, le=4096)
    """Seed nodes per mini-batch."""
    mode: str = field("uniform", choices=("uniform", "weighted"))
    """Neighbour sampling strategy."""

    def validate(self) -> None:
        if len(self.fanouts) > 4:
            raise ValueError("at most 4 hops are supported")


@dataclass
class Trainer:
    workers: int = field(2, ge=1)
    """Number of rollout workers."""
    lr: float = field(3e-4, gt=0)
    """Learning rate."""
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """Pipeline schedule."""
    name: str | None = None
    """Run name; generated when unset."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam betas."""
    tags: dict[str, int] = field(default_factory=dict)
    """Free-form integer tags."""
    clip: Optional[float] = field(None, lt=100)
    """Gradient clip norm."""
    sampler: Sampler = field(default_factory=Sampler)
    """Neighbour sampler."""
    eval_sampler: Sampler = field(default_factory=lambda: Sampler(batch=64))
    """Sampler used for evaluation."""

    def validate(self) -> None:
        if self.schedule == "interleaved" and self.workers % 2:
            raise ValueError(f"schedule 'interleaved' needs an even number of workers, got {self.workers}")


@dataclass
class Required:
    seed: int
    """Random seed (no default)."""
    flag: bool = False


def test_defaults() -> None:
    cfg = load_config(Trainer)
    assert cfg == Trainer()
    assert cfg.sampler.fanouts == [10, 5] and cfg.betas == (0.9, 0.999)
    assert Trainer().sampler.fanouts is not Trainer().sampler.fanouts  # mutable default copied


def test_yaml_then_overrides_in_order(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("workers: 4\nlr: 1e-3\nsampler:\n  fanouts: [15, 10, 5]\n  batch: 128\n")
    cfg = load_config(
        Trainer,
        yaml_path=str(path),
        data={"workers": 3, "name": "from-data", "sampler": {"mode": "weighted"}},
        overrides=["workers=8", "sampler.batch=256", "workers=6", "betas=[0.8, 0.9]", "name=run-1"],
    )
    assert cfg.workers == 6  # last override wins over earlier override, YAML and data
    assert cfg.lr == 1e-3  # YAML 1.1 reads 1e-3 as a string; float fields accept it
    assert cfg.name == "run-1"
    assert cfg.betas == (0.8, 0.9) and isinstance(cfg.betas, tuple)
    assert cfg.sampler == Sampler(fanouts=[15, 10, 5], batch=256, mode="weighted")  # deep merge
    assert cfg.eval_sampler.batch == 64  # untouched nested default keeps the parent's factory value


def test_partial_nested_override_keeps_parent_default_instance() -> None:
    cfg = load_config(Trainer, overrides=["eval_sampler.mode=weighted"])
    assert cfg.eval_sampler == Sampler(batch=64, mode="weighted")


def test_empty_yaml_is_no_override(tmp_path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(Trainer, yaml_path=str(path)) == Trainer()


def test_parse_override() -> None:
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("x=[1, 2]") == ("x", [1, 2])
    assert parse_override("x=null") == ("x", None)
    assert parse_override(" flag = true") == ("flag", True)
    assert parse_override("expr=a=b") == ("expr", "a=b")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("workers")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("=3")


def test_unknown_key_suggests_and_lists() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(Trainer, overrides=["workrs=3"])
    msg = str(exc.value)
    assert "unknown key 'workrs' for Trainer; did you mean 'workers'?" in msg
    assert "valid keys: workers, lr, schedule" in msg


def test_unknown_nested_key_has_full_path() -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(Trainer, {"sampler": {"fanout": [1]}})
    msg = str(exc.value)
    assert "unknown key 'sampler.fanout' for Sampler; did you mean 'sampler.fanouts'?" in msg
    assert "sampler.batch" in msg


def test_unknown_key_without_close_match() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzz' for Trainer; valid keys: workers"):
        from_dict(Trainer, {"zzz": 1})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"workers": "two"}, "workers: expected int, got 'two' (str)"),
        ({"workers": True}, "workers: expected int, got True (bool)"),
        ({"workers": 2.0}, "workers: expected int, got 2.0 (float)"),
        ({"lr": "fast"}, "lr: expected float, got 'fast' (str)"),
        ({"name": 123}, "name: expected str, got 123 (int)"),
        ({"sampler": {"fanouts": [10, "x"]}}, "sampler.fanouts[1]: expected int, got 'x' (str)"),
        ({"sampler": {"fanouts": 10}}, "sampler.fanouts: expected list[int], got 10 (int)"),
        ({"sampler": 3}, "sampler: expected a mapping for Sampler, got 3 (int)"),
        ({"tags": {"a": "b"}}, "tags.a: expected int, got 'b' (str)"),
        ({"betas": [0.9, None]}, "betas[1]: expected float, got None (NoneType)"),
    ],
)
def test_type_errors(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(Trainer, data)
    assert message in str(exc.value)


def test_coercion_accepts() -> None:
    cfg = from_dict(Trainer, {"lr": 1, "name": None, "clip": 5, "tags": {"a": 1}})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.clip == 5.0 and isinstance(cfg.clip, float)
    assert cfg.name is None and cfg.tags == {"a": 1}
    with pytest.raises(ConfigError, match="flag: expected bool, got 'yes'"):
        from_dict(Required, {"seed": 1, "flag": "yes"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"workers": 0}, "workers: must be >= 1, got 0"),
        ({"lr": 0}, "lr: must be > 0, got 0.0"),
        ({"clip": 100}, "clip: must be < 100, got 100.0"),
        ({"sampler": {"batch": 5000}}, "sampler.batch: must be <= 4096, got 5000"),
        ({"sampler": {"fanouts": [10, 0]}}, "sampler.fanouts[1]: must be >= 1, got 0"),
    ],
)
def test_bounds(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(Trainer, data)
    assert message in str(exc.value)


def test_choices_from_literal_and_field() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(Trainer, overrides=["schedule=1f2b"])
    assert "schedule: '1f2b' is not one of 'gpipe', '1f1b', 'interleaved'" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        from_dict(Trainer, {"sampler": {"mode": "random"}})
    assert "sampler.mode: 'random' is not one of 'uniform', 'weighted'" in str(exc.value)


def test_missing_required_key() -> None:
    with pytest.raises(ConfigError, match="missing required key 'seed'"):
        from_dict(Required, {})
    assert from_dict(Required, {"seed": 7}) == Required(seed=7)


def test_yaml_file_errors(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(Trainer, yaml_path=str(missing))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Trainer, yaml_path=str(listy))
    broken = tmp_path / "broken.yaml"
    broken.write_text("workers: [1\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Trainer, yaml_path=str(broken))


def test_validate_hook_cross_field_and_prefix() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(Trainer, overrides=["schedule=interleaved", "workers=3"])
    assert "schedule 'interleaved' needs an even number of workers, got 3" in str(exc.value)
    assert load_config(Trainer, overrides=["schedule=interleaved", "workers=4"]).workers == 4
    # a nested hook's error carries the nested key path
    with pytest.raises(ConfigError, match=r"^sampler: at most 4 hops are supported$"):
        from_dict(Trainer, {"sampler": {"fanouts": [1, 1, 1, 1, 1]}})
    # and from_dict/validate accept an outer prefix for configs embedded elsewhere
    with pytest.raises(ConfigError, match=r"^job\.sampler: at most 4 hops"):
        from_dict(Trainer, {"sampler": {"fanouts": [1] * 5}}, prefix="job")


def test_validate_hand_built_instance() -> None:
    validate(Trainer())
    with pytest.raises(ConfigError, match="workers: must be >= 1, got 0"):
        validate(Trainer(workers=0))
    with pytest.raises(ConfigError, match="schedule: 'bad' is not one of"):
        validate(Trainer(schedule="bad"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"cfg\.sampler\.batch: must be > 0, got -1"):
        validate(Trainer(sampler=Sampler(batch=-1)), prefix="cfg")


def test_post_init_error_becomes_config_error() -> None:
    @dataclass
    class Checked:
        n: int = 1

        def __post_init__(self) -> None:
            if self.n == 13:
                raise ValueError("unlucky")

    @dataclass
    class Outer:
        inner: Checked = field(default_factory=Checked)

    with pytest.raises(ConfigError, match=r"^inner: unlucky$"):
        from_dict(Outer, {"inner": {"n": 13}})


def test_field_docs() -> None:
    docs = field_docs(Trainer)
    assert docs["workers"] == "Number of rollout workers."
    assert docs["schedule"] == "Pipeline schedule."
    assert docs["sampler"] == "Neighbour sampler."
    assert field_docs(Sampler)["fanouts"] == "Neighbours sampled per hop."
    assert "flag" not in field_docs(Required)  # no docstring under it
    assert field_docs(int) == {}  # no source available


def test_field_docs_inherited() -> None:
    @dataclass
    class Child(Sampler):
        extra: int = 0
        """Added by the subclass."""

    docs = field_docs(Child)
    assert docs["extra"] == "Added by the subclass." and docs["batch"] == "Seed nodes per mini-batch."


def test_describe_flattens() -> None:
    rows = {key: (tp, default, doc) for key, tp, default, doc in describe(Trainer)}
    assert rows["workers"] == ("int", 2, "Number of rollout workers.")
    assert rows["schedule"][0] == "Literal['gpipe', '1f1b', 'interleaved']"
    assert rows["name"][:2] == ("str | None", None)
    assert rows["betas"][0] == "tuple[float, ...]"
    assert rows["sampler.fanouts"] == ("list[int]", [10, 5], "Neighbours sampled per hop.")
    assert rows["eval_sampler.batch"][1] == 64  # default from the parent's factory
    assert "sampler" not in rows  # nested dataclasses are expanded, not listed
    assert describe(Required)[0][:3] == ("seed", "int", MISSING)


def test_to_dict_from_dict_round_trip() -> None:
    cfg = load_config(Trainer, overrides=["workers=4", "name=x", "tags={a: 1}", "sampler.fanouts=[3]"])
    plain = to_dict(cfg)
    assert plain["betas"] == [0.9, 0.999] and plain["sampler"]["fanouts"] == [3]
    assert json.loads(json.dumps(plain)) == plain
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    assert from_dict(Trainer, plain) == cfg
    assert dataclasses.asdict(cfg)["sampler"] == plain["sampler"]


def test_data_argument_not_mutated() -> None:
    data = {"sampler": {"batch": 8}}
    load_config(Trainer, data=data, overrides=["sampler.batch=16"])
    assert data == {"sampler": {"batch": 8}}
