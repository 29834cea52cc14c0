import subprocess
import sys

import pytest
import yaml

from conftest import PROJECT, REFERENCE_TASK, machinery_project, project_config, reference_config
from engine.config import Config, check_positive, save_config, shown
from engine.errors import ConfigError

CONFIG_YAML = REFERENCE_TASK / "config.yaml"

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def test_shipped_config_loads(tmp_path):
    cfg = reference_config(CONFIG_YAML)
    assert isinstance(cfg, Config)
    assert cfg.data.name == "synthetic" and cfg.checkpoint.resume == "auto"


def test_overrides_are_typed_from_the_schema():
    cfg = reference_config(CONFIG_YAML, ["train.lr=0.25", "train.epochs=7", "data.augment=false", "output_dir=x"])
    assert cfg.train.lr == 0.25 and isinstance(cfg.train.lr, float)
    assert cfg.train.epochs == 7 and cfg.data.augment is False and cfg.output_dir == "x"


def test_yaml_float_without_dot_is_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n")
    assert reference_config(path).train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=0.1", "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
        ("lr=0.1", "unknown config key 'lr' (did you mean 'train.lr'?)"),
        ("train.epochs=ten", "train.epochs must be int, got 'ten'"),
        ("data.augment=maybe", "data.augment must be bool, got 'maybe'"),
        ("train.batch_size=0", "train.batch_size must be > 0, got 0"),
        ("train.lr=-1", "train.lr must be > 0, got -1.0"),
        ("data.name=imagenet", "data.name must be one of synthetic, imagefolder, cifar10; got 'imagenet'"),
        ("train=3", "train must be a section (key: value lines)"),
        ("train.lr", "override 'train.lr' is not of the form section.key=value"),
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
    path.write_text("seed: 1\ntrain:\n  lr: [0.1\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml line \d+: YAML syntax error"):
        reference_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found"):
        reference_config("nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = reference_config(CONFIG_YAML, ["train.lr=0.3"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert reference_config(tmp_path / "resolved.yaml") == cfg


def test_static_graph_with_accumulation_is_refused():
    with pytest.raises(ConfigError, match="dist.static_graph=true does not work with train.accum_steps > 1"):
        reference_config(CONFIG_YAML, ["dist.static_graph=true", "train.accum_steps=2"])


def test_print_config_shows_every_key_with_its_meaning():
    shown = subprocess.run(
        [sys.executable, "train.py", "--print-config", "train.lr=0.3"],
        cwd=machinery_project(),
        capture_output=True,
        text=True,
    ).stdout
    reparsed = reference_config(None, base=yaml.safe_load(shown))
    assert reparsed == reference_config(CONFIG_YAML, ["train.lr=0.3"])
    assert "lr: 0.3" in shown and "(default 0.2)" in shown
    assert "  best_metric: val_acc" in shown and "(default val_loss)" in shown
    assert "  name: synthetic                        # synthetic (made from the seed) | imagefolder | cifar10" in shown


def test_task_sections_are_checked_like_the_rest():
    with pytest.raises(ConfigError, match=r"^unknown config key 'model.hidden' \(did you mean 'model.hidden_dim'\?\)$"):
        reference_config(None, ["model.hidden=3"])
    with pytest.raises(ConfigError, match=r"^data.image_size must be int, got 'big'$"):
        reference_config(None, ["data.image_size=big"])


def test_your_config_yaml_writes_no_default_twice():
    """config.yaml holds only what differs from the schema, so the two cannot drift apart
    (your config.yaml and your task's sections: this holds for any task)."""
    defaults = project_config(None)
    written = yaml.safe_load((PROJECT / "config.yaml").read_text())
    for section, values in written.items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            default = getattr(defaults, section) if key is None else getattr(getattr(defaults, section), key)
            assert value != default, f"{section}.{key} repeats its default {default!r}; delete it from config.yaml"


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_key_written_twice_in_a_section_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml line 3: key 'lr' is written twice in one section \(first on line 2\); keep one$"
    ):
        reference_config(path)


def test_section_written_twice_is_refused(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\nseed: 1\ntrain:\n  epochs: 2\n")
    with pytest.raises(
        ConfigError, match=r"c.yaml line 4: key 'train' is written twice in one section \(first on line 1\)"
    ):
        reference_config(path)


def test_yaml_merge_keys_still_work(tmp_path):
    """A key written once beside a merged mapping (`<<`) overrides it: not a duplicate."""
    cfg = reference_config(write(tmp_path, "train:\n  <<: {lr: 0.1, epochs: 3}\n  lr: 0.3\n"))
    assert cfg.train.lr == 0.3 and cfg.train.epochs == 3


@pytest.mark.parametrize(
    "override, message",
    [
        ("dist.timeout_minutes=1e300", "dist.timeout_minutes must be at most 1e+06, got 1e+300"),
        ("dist.step_timeout_minutes=1e7", "dist.step_timeout_minutes must be at most 1e+06, got 10000000.0"),
        ("train.warmup_epochs=1e307", "train.warmup_epochs must be at most 1e+06, got 1e+307"),
    ],
)
def test_finite_numbers_too_large_to_mean_anything_are_refused(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [override])
    assert str(error.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=nan", "train.lr must be a finite number, got nan"),
        ("train.momentum=inf", "train.momentum must be a finite number, got inf"),
        ("train.weight_decay=nan", "train.weight_decay must be a finite number, got nan"),
        ("train.grad_clip=nan", "train.grad_clip must be a finite number, got nan"),
        ("train.warmup_epochs=inf", "train.warmup_epochs must be a finite number, got inf"),
        ("train.lr=1e400", "train.lr must be a finite number, got inf"),
        ("dist.timeout_minutes=nan", "dist.timeout_minutes must be a finite number, got nan"),
        ("dist.bucket_cap_mb=-inf", "dist.bucket_cap_mb must be a finite number, got -inf"),
        ("model.dropout=nan", "model.dropout must be a finite number, got nan"),  # the task's sections too
    ],
)
def test_non_finite_numbers_are_refused(override, message):
    with pytest.raises(ConfigError) as error:
        reference_config(CONFIG_YAML, [override])
    assert str(error.value) == message


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  lr: .nan\n", "train.lr must be a finite number, got nan"),
        (
            "train:\n  early_stopping_min_delta: .inf\n",
            "train.early_stopping_min_delta must be a finite number, got inf",
        ),
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
    path = write(tmp_path, "train: {lr: [" + ", ".join(levels) + "]}\n")
    with pytest.raises(ConfigError) as error:
        reference_config(path)
    message = str(error.value)
    assert message.startswith("train.lr must be float, got list [['x', 'x',") and len(message) < 150


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
    path.write_bytes(b"seed: 1\ntrain:\n  lr: 0.1  # caf\xe9\n")
    with pytest.raises(
        ConfigError,
        match=r"^config file '.*c.yaml' is not UTF-8 text: byte 0xe9 at position 31 \(line 3\) is not valid",
    ):
        reference_config(path)


def test_control_character_in_config_names_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"seed: 1\ntrain:\n  lr: 0.1\x00\n")
    with pytest.raises(ConfigError, match=r"c.yaml line 3: character U\+0000 is not allowed in YAML$"):
        reference_config(path)


@pytest.mark.parametrize(
    "config, args, message",
    [
        (None, ["train.lr=nan"], "error: train.lr must be a finite number, got nan"),
        ("train:\n  lr: 0.1\n  lr: 0.2\n", [], "error: bad.yaml line 3: key 'lr' is written twice in one section"),
        (b"train:\n  lr: 0.1 \xff\n", [], "error: config file 'bad.yaml' is not UTF-8 text: byte 0xff at position 17"),
    ],
)
def test_bad_config_stops_train_py_with_one_line(config, args, message):
    project = machinery_project()
    if config is not None:
        path = project / "bad.yaml"
        path.write_bytes(config if isinstance(config, bytes) else config.encode())
        args = ["--config", "bad.yaml", *args]
    run = subprocess.run([sys.executable, "train.py", *args], cwd=project, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith(message) and run.stderr.count("\n") == 1, run.stderr
