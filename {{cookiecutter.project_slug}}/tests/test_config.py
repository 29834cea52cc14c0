import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

import pytest
import yaml

from conftest import (
    PROJECT,
    REFERENCE_TASK,
    has,
    project_config,
    reference_config,
    reference_task,
)
from engine import hooks
from engine.config import (
    MOVED_KEYS,
    Config,
    all_keys,
    check_positive,
    format_config,
    load_config,
    save_config,
    shown,
)
from engine.errors import ConfigError

CONFIG_YAML = REFERENCE_TASK / "config.yaml"

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def test_shipped_config_loads(tmp_path):
    cfg = reference_config(CONFIG_YAML)
    assert isinstance(cfg, Config)
    assert cfg.data.name == "synthetic" and cfg.checkpoint.resume == "auto"


def test_overrides_are_typed_from_the_schema():
    cfg = reference_config(CONFIG_YAML, ["optim.lr=0.25", "train.epochs=7", "data.augment=false", "output_dir=x"])
    assert cfg.optim.lr == 0.25 and isinstance(cfg.optim.lr, float)
    assert cfg.train.epochs == 7 and cfg.data.augment is False and cfg.output_dir == "x"


def test_yaml_float_without_dot_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n")
    assert reference_config(path).optim.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=0.1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("train.lr=0.1", "config key 'train.lr' moved to 'optim.lr'; rename it"),
        ("lr=0.1", "unknown config key 'lr' (did you mean 'optim.lr'?)"),
        ("train.epochs=ten", "train.epochs must be int, got 'ten'"),
        ("data.augment=maybe", "data.augment must be bool, got 'maybe'"),
        ("train.batch_size=0", "train.batch_size must be > 0, got 0"),
        ("optim.lr=-1", "optim.lr must be > 0, got -1.0"),
        ("data.name=imagenet", "data.name must be one of synthetic, imagefolder, cifar10; got 'imagenet'"),
        ("train=3", "train must be a section (key: value lines)"),
        ("optim.lr", "override 'optim.lr' is not of the form section.key=value"),
    ],
)
def test_bad_override_names_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [override])
    assert str(error.value) == message


def test_wrong_type_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 2.5\n")
    with pytest.raises(ConfigError, match=r"^train.epochs must be int, got float 2.5$"):
        reference_config(path)


def test_yaml_syntax_error_gives_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\noptim:\n  lr: [0.1\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml line \d+: YAML syntax error"):
        reference_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found"):
        reference_config("nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = reference_config(CONFIG_YAML, ["optim.lr=0.3"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert reference_config(tmp_path / "resolved.yaml") == cfg


def test_static_graph_with_accumulation_is_refused():
    with pytest.raises(ConfigError, match="dist.static_graph=true does not work with train.accum_steps > 1"):
        reference_config(CONFIG_YAML, ["dist.static_graph=true", "train.accum_steps=2"])


def test_task_sections_are_checked_like_the_rest():
    with pytest.raises(ConfigError, match=r"^unknown config key 'model.hidden' \(did you mean 'model.hidden_dim'\?\)$"):
        reference_config(None, ["model.hidden=3"])
    with pytest.raises(ConfigError, match=r"^data.image_size must be int, got 'big'$"):
        reference_config(None, ["data.image_size=big"])


def test_your_config_yaml_loads():
    """Every key of your config.yaml is one of the schema's, with a value it takes; a key
    may repeat its default (a recipe written out in full)."""
    written = yaml.safe_load((PROJECT / "config.yaml").read_text()) or {}
    cfg = project_config(PROJECT / "config.yaml")
    for section, values in written.items():
        for key, value in values.items() if isinstance(values, dict) else []:
            assert getattr(getattr(cfg, section), key) == value, f"config.yaml: {section}.{key} loads otherwise"


# A setting config.yaml shows commented out: "# " before a YAML line that begins with a
# key (a section, or a key of one); deleting the "# " uncomments it.
COMMENTED_SETTING = re.compile(r"^( *)# ( *)([a-z_][a-z0-9_]*):(?: (.*))?$")


def commented_settings(text: str) -> list[tuple[str, str]]:
    """The settings config.yaml shows commented out, as (dotted key, value) overrides: each is
    tried on top of the file as it is, so sections you wrote yourself below them still load."""
    settings, section = [], ""
    for line in text.splitlines():
        setting = COMMENTED_SETTING.match(line)
        if not setting:  # a section written out (detection's train:) holds the commented keys below it
            written = re.match(r"([a-z_][a-z0-9_]*):", line)
            section = written[1] if written else section
            continue
        indent, key, value = setting[1] + setting[2], setting[3], (setting[4] or "").split(" #")[0].strip()
        if not indent:
            section = key
        if value:  # a value, not a section's line
            settings.append((f"{section}.{key}" if indent else key, value))
    return settings


@pytest.mark.parametrize("which", ["yours", "yours with your own sections below", "reference"])
def test_the_settings_config_yaml_shows_commented_out_load_when_uncommented(tmp_path, which):
    """config.yaml shows the settings a new project changes first, commented out: each,
    uncommented, must be a key of the schema with a valid value (the example's: other than
    its default), so that a renamed key or a value no longer taken fails here, not in a
    user's first run. Sections you write below them are yours: they do not clash."""
    yours = which != "reference"
    config, path = (project_config, PROJECT / "config.yaml") if yours else (reference_config, CONFIG_YAML)
    if which == "yours with your own sections below":
        path = write(tmp_path, path.read_text() + "\ndata: {}\n")
    settings = commented_settings(path.read_text())
    assert settings or yours, "the example's config.yaml shows no commented-out setting"
    try:
        cfg = config(path, [f"{key}={value}" for key, value in settings])
    except ConfigError as error:
        pytest.fail(f"config.yaml shows a commented-out setting that fails uncommented: {error}; correct or delete it")
    defaults = config(None)
    for key, _ in [] if yours else settings:
        value, default = (functools.reduce(getattr, key.split("."), c) for c in (cfg, defaults))
        assert value != default, f"config.yaml shows {key}: {value!r}, its default; show a value to change it to"


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_key_written_twice_in_a_section_is_refused(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml line 3: key 'lr' is written twice in one section \(first on line 2\); keep one$"
    ):
        reference_config(path)


def test_section_written_twice_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 1\nseed: 1\ntrain:\n  epochs: 2\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml line 4: key 'train' is written twice in one section \(first on line 1\)"
    ):
        reference_config(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("1: 2\n", "line 1: key '1' is read as a number, not a name; write a name"),
        ("~: x\n", "line 1: key '~' is read as null, not a name; write a name"),
        ("train: {1.5: x}\n", "line 1: key '1.5' is read as a number, not a name; write a name"),
        ("optim:\n  true: 1\n", "line 2: key 'true' is read as a boolean, not a name; write a name"),
    ],
)
def test_a_key_yaml_reads_as_a_number_a_bool_or_null_is_refused(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        reference_config(write(tmp_path, text))
    assert str(error.value) == f"{tmp_path / 'c.yaml'} {message}"


def test_a_value_nested_thousands_deep_is_one_line(tmp_path):
    deep = "[" * 3000 + "]" * 3000
    with pytest.raises(ConfigError, match=r"c.yaml' nests a value hundreds of levels deep, too deep to read;"):
        reference_config(write(tmp_path, f"model:\n  widths: {deep}\n"))
    with pytest.raises(ConfigError, match=r"^a value in the config or an override nests hundreds of levels deep"):
        reference_config(None, [f"train.epochs={deep}"])


@pytest.mark.parametrize("key", ["timeout_minutes", "step_timeout_minutes"])
@pytest.mark.parametrize("value", ["1e-9", "0.001", "0"])
def test_a_timeout_too_short_for_any_collective_is_refused(key, value):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [f"dist.{key}={value}"])
    assert str(error.value) == f"dist.{key} is in minutes: at least 0.05 (3 s), got {float(value)!r}"


def test_yaml_merge_keys_still_work(tmp_path):
    """A key written once beside a merged mapping (`<<`) overrides it: not a duplicate."""
    cfg = reference_config(write(tmp_path, "optim:\n  <<: {lr: 0.1, momentum: 0.5}\n  lr: 0.3\n"))
    assert cfg.optim.lr == 0.3 and cfg.optim.momentum == 0.5


@pytest.mark.parametrize(
    "override, message",
    [
        ("dist.timeout_minutes=1e300", "dist.timeout_minutes must be at most 1e+06, got 1e+300"),
        ("dist.step_timeout_minutes=1e7", "dist.step_timeout_minutes must be at most 1e+06, got 10000000.0"),
        ("optim.warmup_epochs=1e307", "optim.warmup_epochs must be at most 1e+06, got 1e+307"),
        ("dist.bucket_cap_mb=1e308", "dist.bucket_cap_mb must be at most 1e+06, got 1e+308"),
    ],
)
def test_finite_numbers_too_large_to_mean_anything_are_refused(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [override])
    assert str(error.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=.nan", "optim.lr must be a finite number, got nan"),
        ("optim.momentum=.inf", "optim.momentum must be a finite number, got inf"),
        ("optim.weight_decay=.NaN", "optim.weight_decay must be a finite number, got nan"),
        ("train.grad_clip=.NAN", "train.grad_clip must be a finite number, got nan"),
        ("optim.warmup_epochs=+.inf", "optim.warmup_epochs must be a finite number, got inf"),
        ("optim.lr=1e400", "optim.lr must be a finite number, got inf"),
        ("dist.timeout_minutes=.nan", "dist.timeout_minutes must be a finite number, got nan"),
        ("dist.bucket_cap_mb=-.inf", "dist.bucket_cap_mb must be a finite number, got -inf"),
        ("model.dropout=.nan", "model.dropout must be a finite number, got nan"),  # the task's sections too
        ("optim.lr=nan", "optim.lr must be float, got 'nan'"),  # YAML 1.2 writes .nan; nan is text
    ],
)
def test_non_finite_numbers_are_refused(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [override])
    assert str(error.value) == message


@pytest.mark.parametrize(
    "text, message",
    [
        ("optim:\n  lr: .nan\n", "optim.lr must be a finite number, got nan"),
        ("train:\n  grad_clip: .inf\n", "train.grad_clip must be a finite number, got inf"),
        ("dist:\n  step_timeout_minutes: 1.0e999\n", "dist.step_timeout_minutes must be a finite number, got inf"),
        ("model:\n  dropout: -.inf\n", "model.dropout must be a finite number, got -inf"),
    ],
)
def test_non_finite_numbers_in_yaml_are_refused(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        reference_config(write(tmp_path, text))
    assert str(error.value) == message


def test_huge_integers_are_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^train.epochs must be between -2\*\*63 and 2\*\*63 - 1, got 1000000000000000000000$"
    ):
        reference_config(None, ["train.epochs=1" + "0" * 21])
    with pytest.raises(
        ConfigError, match=r"^seed must be between -2\*\*63 and 2\*\*63 - 1, got <an integer of 20000 bits>$"
    ):
        reference_config(write(tmp_path, f"seed: 0x{'f' * 5000}\n"))
    with pytest.raises(ConfigError, match=r"c.yaml line 2: the number '1111.*' is too long"):
        reference_config(write(tmp_path, f"train:\n  epochs: {'1' * 5000}\n"))


@pytest.mark.parametrize("allow_zero", [False, True])
def test_check_positive_is_not_fooled_by_nan(allow_zero):
    with pytest.raises(ConfigError, match="x must be"):
        check_positive("x", float("nan"), allow_zero=allow_zero)


def test_alias_bomb_gives_a_short_message(tmp_path):
    """A "billion laughs" document: 320 bytes, 9**9 strings if printed in full."""
    levels = ['&a ["x","x","x","x","x","x","x","x","x"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"&{name} [{','.join(['*' + previous] * 9)}]")
    path = write(tmp_path, "optim: {lr: [" + ", ".join(levels) + "]}\n")
    with pytest.raises(ConfigError) as error:
        reference_config(path)
    message = str(error.value)
    assert message.startswith("optim.lr must be float, got list [['x', 'x',") and len(message) < 150


def test_long_values_are_cut_short_in_messages():
    with pytest.raises(ConfigError) as error:
        reference_config(None, ["data.name=" + "x" * 1_000_000])  # check_choice, from the task's section
    message = str(error.value)
    assert (
        message.startswith("data.name must be one of synthetic, imagefolder, cifar10; got 'xxx") and len(message) < 150
    )
    assert len(shown("y" * 10_000)) <= 80 and shown([1, [2, [3, [4, [5]]]]]).startswith("[1, [2, [")


def test_config_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"seed: 1\noptim:\n  lr: 0.1  # caf\xe9\n")
    with pytest.raises(
        ConfigError,
        match=r"^config file '.*c.yaml' is not UTF-8 text: byte 0xe9 at position 31 \(line 3\) is not valid",
    ):
        reference_config(path)


def test_control_character_in_config_names_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"seed: 1\noptim:\n  lr: 0.1\x00\n")
    with pytest.raises(ConfigError, match=r"c.yaml line 3: character U\+0000 is not allowed in YAML$"):
        reference_config(path)


# Richer field types, on small sections of the test's own (not the example task's).


@dataclass
class Head:
    dropout: float = 0.0  # before the last layer
    widths: tuple[int, ...] = ()


@dataclass
class RichModel:
    widths: list[int] = field(default_factory=lambda: [16, 32])  # channel widths
    size: tuple[int, int] = (224, 224)  # input height, width
    # one per level: a comment above its field
    scales: tuple[float, ...] = (1.0,)
    offset: int | None = None  # none: no offset
    tag: Optional[str] = None  # noqa: UP045 (the spelling of older code, which must work too)
    act: Literal["relu", "gelu"] = "relu"  # activation
    head: Head = field(default_factory=Head)
    extra: Head | None = None
    heads: list[Head] = field(default_factory=list)

    may_change_on_resume: ClassVar[tuple[str, ...]] = ("tag",)  # not a key: a ClassVar


@dataclass
class TinyData:
    name: str = "tiny"


def rich_config(path=None, overrides=(), base=None, model=RichModel):
    return load_config(path, list(overrides), data=TinyData, model=model, base=base)


RICH_YAML = """\
model:
  widths: [32, 64]
  size: [128, 96]
  scales: [0.5, 1e-3]
  offset: -3
  tag: night
  act: gelu
  head: {dropout: 0.1, widths: [8]}
  extra: {dropout: 0.2}
  heads: [{dropout: 0.3}, {widths: [1, 2]}]
"""
RICH_OVERRIDES = [
    "model.widths=[32,64]",
    "model.size=[128, 96]",
    "model.scales=[0.5,1e-3]",
    "model.offset=-3",
    "model.tag=night",
    "model.act=gelu",
    "model.head.dropout=0.1",
    "model.head.widths=[8]",
    "model.extra.dropout=0.2",
    "model.heads=[{dropout: 0.3}, {widths: [1, 2]}]",
]
RICH_MODEL = RichModel(
    widths=[32, 64],
    size=(128, 96),
    scales=(0.5, 1e-3),
    offset=-3,
    tag="night",
    act="gelu",
    head=Head(0.1, (8,)),
    extra=Head(0.2),
    heads=[Head(0.3), Head(widths=(1, 2))],
)


def test_rich_types_from_yaml(tmp_path):
    model = rich_config(write(tmp_path, RICH_YAML)).model
    assert model == RICH_MODEL
    assert type(model.size) is tuple and type(model.heads[1].widths) is tuple and type(model.scales[1]) is float


def test_rich_types_from_the_command_line():
    model = rich_config(None, RICH_OVERRIDES).model
    assert model == RICH_MODEL
    assert type(model.size) is tuple and type(model.head.widths) is tuple


def test_rich_type_defaults_are_kept():
    assert rich_config().model == RichModel()


@pytest.mark.parametrize("spelling", ["null", "~"])
def test_null_for_optional_fields(tmp_path, spelling):
    path = write(tmp_path, "model:\n  offset: 5\n  extra: {dropout: 0.5}\n  tag: x\n")
    model = rich_config(path, [f"model.offset={spelling}", f"model.extra={spelling}", f"model.tag={spelling}"]).model
    assert model.offset is None and model.extra is None and model.tag is None
    model = rich_config(write(tmp_path, f"model:\n  offset: {spelling}\n  tag: {spelling}\n")).model
    assert model.offset is None and model.tag is None


def test_optional_text_from_the_command_line_stays_text():
    assert rich_config(None, ["model.tag=7", "model.offset=7"]).model == RichModel(tag="7", offset=7)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.widths=[32,x]", "model.widths[1] must be int, got str 'x'"),
        ("model.widths=32", "model.widths must be list[int], got int 32"),
        ("model.widths=[32", "model.widths must be a YAML value such as [1, 2], got '[32'"),
        ("model.size=[1,2,3]", "model.size must be tuple[int, int]: 2 items, got 3: [1, 2, 3]"),
        ("model.size=[1,true]", "model.size[1] must be int, got bool True"),
        ("model.scales=[1.0,.nan]", "model.scales[1] must be a finite number, got nan"),
        ("model.offset=abc", "model.offset must be int, got 'abc'"),
        ("model.act=tanh", "model.act must be one of relu, gelu; got 'tanh'"),
        ("model.head.dropout=x", "model.head.dropout must be float, got 'x'"),
        ("model.head.widths=[1,[2]]", "model.head.widths[1] must be int, got list [2]"),
        ("model.head.dropoutt=1", "unknown config key 'model.head.dropoutt' (did you mean 'model.head.dropout'?)"),
        ("model.heads=[{dropout: x}]", "model.heads[0].dropout must be float, got str 'x'"),
        ("model.extra.dropot=1", "unknown config key 'model.extra.dropot' (did you mean 'model.extra.dropout'?)"),
        ("model.heads=[{drop: 1}]", "unknown config key 'model.heads[0].drop'"),
        ("model.heads=[3]", "model.heads[0] must be a section (key: value lines)"),
    ],
)
def test_wrong_rich_value_on_the_command_line_names_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        rich_config(None, [override])
    assert str(error.value) == message


@pytest.mark.parametrize(
    "text, message",
    [
        ("widths: [32, x]", "model.widths[1] must be int, got str 'x'"),
        ("widths: 32,64", "model.widths must be list[int], got str '32,64'"),
        ("size: [1]", "model.size must be tuple[int, int]: 2 items, got 1: [1]"),
        ("scales: [.inf]", "model.scales[0] must be a finite number, got inf"),
        ("offset: 2.5", "model.offset must be int, got float 2.5"),
        ("act: tanh", "model.act must be one of relu, gelu; got 'tanh'"),
        ("act: 1", "model.act must be one of relu, gelu; got 1"),
        ("head: 3", "model.head must be a section (key: value lines)"),
        ("extra: {dropout: [1]}", "model.extra.dropout must be float, got list [1]"),
        ("heads: [{dropout: 0.1}, {widths: [1, x]}]", "model.heads[1].widths[1] must be int, got str 'x'"),
    ],
)
def test_wrong_rich_value_in_yaml_names_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        rich_config(write(tmp_path, f"model:\n  {text}\n"))
    assert str(error.value) == message


@pytest.mark.parametrize(
    "kind, shown_as",
    [(dict[str, int], "dict[str, int]"), (set[int], "set[int]"), (Path, "Path"), (int | str, "int | str")],
)
def test_unsupported_field_type_is_refused_at_load(kind, shown_as):
    """Refused even when no value is given: the field is wrong whatever the config says."""
    model = dataclasses.make_dataclass("BadModel", [("weights", kind, field(default=None))])
    with pytest.raises(ConfigError) as error:
        rich_config(model=model)
    assert str(error.value) == (  # the whole line: the field, its type, the types there are
        f"model.weights has type {shown_as}, which a config cannot hold; use bool, int, float, str, "
        "list[T], tuple[T, ...], tuple[T1, T2], T | None, Literal[...] or a dataclass (a sub-section)"
    )


def test_unsupported_type_inside_a_container_is_refused():
    model = dataclasses.make_dataclass("BadModel", [("layers", list[dict], field(default_factory=list))])
    with pytest.raises(ConfigError, match=r"^model.layers has type list\[dict\], which a config cannot hold; "):
        rich_config(model=model)


def test_rich_config_round_trips_through_print_config(tmp_path):
    cfg = rich_config(None, RICH_OVERRIDES)
    text = format_config(cfg)
    assert rich_config(None, base=yaml.safe_load(text)) == cfg
    save_config(cfg, tmp_path / "resolved.yaml")
    assert rich_config(tmp_path / "resolved.yaml") == cfg
    assert rich_config(None, base=yaml.safe_load(format_config(rich_config()))) == rich_config()
    lines = text.splitlines()
    assert f"{'  widths: [32, 64]':<40} # channel widths (default [16, 32])" in lines
    assert f"{'  size: [128, 96]':<40} # input height, width (default [224, 224])" in lines
    assert f"{'  offset: -3':<40} # none: no offset (default null)" in lines
    assert f"{'  act: gelu':<40} # activation (default relu)" in lines
    assert "  heads: [{dropout: 0.3, widths: []}, {dropout: 0.0, widths: [1, 2]}] # (default [])" in lines
    assert "  head:" in lines and f"{'    dropout: 0.1':<40} # before the last layer (default 0.0)" in lines


def test_default_factory_values_show_as_defaults():
    lines = format_config(rich_config()).splitlines()
    assert f"{'  widths: [16, 32]':<40} # channel widths" in lines
    assert f"{'  scales: [1.0]':<40} # one per level: a comment above its field" in lines
    assert "  heads: []" in lines and "  extra: null" in lines


def test_config_from_a_checkpoint_dict_gets_its_tuples_back():
    """A checkpoint stores cfg.to_dict(): YAML's types, lists for tuples; the schema's
    tuples are tuples again."""
    cfg = rich_config(None, RICH_OVERRIDES)
    stored = yaml.safe_load(yaml.safe_dump(cfg.to_dict()))
    assert stored["model"]["size"] == [128, 96]
    loaded = rich_config(None, [], base=stored)
    assert loaded == cfg and type(loaded.model.size) is tuple and type(loaded.model.heads[1].widths) is tuple
    assert rich_config(None, [], base=cfg.to_dict()) == cfg


# The file and the command line read a value alike, as YAML 1.2's core schema does: 010 is
# 10, 0o10 is 8, 1:00 and yes are text, booleans are true and false only.


@dataclass
class Scalars:
    count: int = 0
    rate: float = 0.0
    flag: bool = False
    limit: int | None = 0
    sizes: list[int] = field(default_factory=list)


SPELLINGS = [
    *("010", "0o10", "0x1F", "0b11", "1_000", "1:00", "1e-3", "1E3", ".5", "1.", "+1", "-0"),
    *(".inf", "-.inf", ".nan", "nan", "inf", "yes", "on", "off", "y", "True", "TRUE", "tRuE", "false"),
    *("null", "~", "NULL", "2024-01-01"),
]


def read_value(name, path=None, overrides=()):
    """model.`name` as read (its repr: 1, 1.0 and True apart), or "refused" by an error naming it."""
    try:
        value = getattr(rich_config(path, overrides, model=Scalars).model, name)
    except ConfigError as error:
        assert str(error).startswith(f"model.{name}"), str(error)
        return "refused"
    return repr(value)


def from_file(tmp_path, name, spelling):
    return read_value(name, write(tmp_path, f"model:\n  {name}: {spelling}\n"))


def from_command_line(name, spelling):
    return read_value(name, overrides=[f"model.{name}={spelling}"])


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("name", ["count", "rate", "flag", "limit"])
def test_the_file_and_the_command_line_read_a_value_alike(tmp_path, name, spelling):
    assert from_file(tmp_path, name, spelling) == from_command_line(name, spelling)


@pytest.mark.parametrize(
    "name, spelling, value",
    [
        *[("count", s, v) for s, v in [("010", 10), ("0o10", 8), ("0x1F", 31), ("+1", 1), ("-0", 0)]],
        *[("count", s, "refused") for s in ("1_000", "1:00", "0b11", "1e3", "yes", "1.0")],
        *[("rate", s, v) for s, v in [("1e-3", 0.001), ("1E3", 1000.0), (".5", 0.5), ("1.", 1.0), ("010", 10.0)]],
        *[("rate", s, "refused") for s in ("1_000.5", "1:00.5", ".inf", ".nan", "nan", "inf")],
        *[("flag", s, True) for s in ("true", "True", "TRUE")],
        *[("flag", s, "refused") for s in ("yes", "on", "y", "tRuE", "1")],
        *[("limit", s, None) for s in ("null", "Null", "NULL", "~")],
        *[("sizes", s, v) for s, v in [("[010, 0o10, 0x10]", [10, 8, 16]), ("[+1, -0]", [1, 0])]],
        *[("sizes", s, "refused") for s in ("[1_000]", "[1:00]", "[yes]")],
    ],
)
def test_values_read_as_yaml_1_2s_core_schema_says(tmp_path, name, spelling, value):
    expected = value if value == "refused" else repr(value)
    assert from_file(tmp_path, name, spelling) == expected
    assert from_command_line(name, spelling) == expected


def test_text_that_yaml_1_2_reads_as_a_number_is_saved_quoted(tmp_path):
    """A saved config reads back as the same value, here and in a YAML 1.1 reader."""
    for text in ("1e5", "0o17", "+.5", "yes", "010", "1:00"):  # numbers in YAML 1.2, then in YAML 1.1
        cfg = rich_config(None, [f"model.tag={text}"])
        save_config(cfg, tmp_path / "resolved.yaml")
        assert rich_config(tmp_path / "resolved.yaml").model.tag == text
        assert yaml.safe_load((tmp_path / "resolved.yaml").read_text())["model"]["tag"] == text


def test_a_key_given_twice_on_the_command_line_is_refused():
    with pytest.raises(ConfigError) as error:
        rich_config(None, ["model.offset=1", "model.act=gelu", " model.offset =2"])
    assert str(error.value) == "model.offset is given twice on the command line ('1', then '2'); give it once"


NO_PART = "a part answered no at generation has no settings; .cookiecutter.json lists the answers"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.optimizer=adamw", "config key 'train.optimizer' moved to 'optim.name'; rename it"),
        ("train.lr=0.1", "config key 'train.lr' moved to 'optim.lr'; rename it"),
        ("train.warmup_epochs=2", "config key 'train.warmup_epochs' moved to 'optim.warmup_epochs'; rename it"),
        *(
            [  # the fsdp part's
                (
                    "train.strategy=fsdp",
                    "config key 'train.strategy' moved to 'fsdp.enabled'; "
                    "set fsdp.enabled=true for strategy fsdp, false for ddp",
                )
            ]
            if has("engine/parts/fsdp.py")
            else []
        ),
        ("optim.lrr=0.1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("train.compiled=true", "unknown config key 'train.compiled' (did you mean 'train.compile'?)"),
        ("model.lr=0.1", "unknown config key 'model.lr' (did you mean 'optim.lr'?)"),  # in another section
        ("train.zzz=1", "unknown config key 'train.zzz'"),
        ("train.optimiser=sgd", "unknown config key 'train.optimiser'"),
        *[  # a section no schema has, as that of a part the project was generated without
            (f"{section}{rest}", f"unknown config key {section!r} ({NO_PART})")
            for section, rest in [("bogus", "=1"), ("fsdp", ".enabled=true"), ("ema", ".decay=0.999")]
            if not has(f"engine/parts/{section}.py")
        ],
    ],
)
def test_a_moved_key_says_where_it_went_and_a_suggestion_is_close(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(None, [override])
    assert str(error.value) == message


def test_a_moved_key_in_a_file_says_where_it_went(tmp_path):
    with pytest.raises(ConfigError) as error:
        reference_config(write(tmp_path, "train:\n  epochs: 2\n  optimizer: adamw\n"))
    assert str(error.value) == "config key 'train.optimizer' moved to 'optim.name'; rename it"


def test_each_moved_key_is_gone_and_goes_to_a_key_of_the_schema_or_of_a_part():
    task = reference_task()
    sections = {"data": task.data.DataConfig, "model": task.model.ModelConfig, "optim": task.recipe.OptimConfig}
    known = set(all_keys(Config, sections | hooks.sections()))
    parts_not_here = {"ema", "early_stopping", "freeze", "fsdp", "profiler", "tracking"} - hooks.sections().keys()
    for old, new in MOVED_KEYS.items():
        assert old not in known and (new in known or new.split(".")[0] in parts_not_here), (old, new)
