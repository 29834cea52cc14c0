import subprocess
import sys

import pytest
import yaml

from conftest import PROJECT, REFERENCE_TASK, machinery_project, project_config, reference_config
from engine.config import Config, save_config
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
