"""Your task's tests: they run train.py on your model.py, data.py and config.yaml.

Adapt them when you change the task (the machinery's own tests, in the other files, run
on tests/reference_task and need no change)."""

import math

import pytest
import yaml

from conftest import PROJECT, project_config, read_metrics, run_script


def test_config_yaml_writes_no_default_twice():
    """config.yaml holds only what differs from the schema, so the two cannot drift apart."""
    defaults = project_config(None)
    written = yaml.safe_load((PROJECT / "config.yaml").read_text())
    for section, values in written.items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            default = getattr(defaults, section) if key is None else getattr(getattr(defaults, section), key)
            assert value != default, f"{section}.{key} repeats its default {default!r}; delete it from config.yaml"


# The default recipe (lr, warmup, schedule, clipping, weight decay, augmentation) on a
# smaller and cheaper copy of the default data: only sizes are set here, the same for
# every world size (so 4 processes make 4 times fewer, 4 times larger steps).
SMALL_DEFAULT_RUN = [
    "data.image_size=8",
    "data.train_size=2048",
    "data.val_size=200",
    "train.batch_size=32",
    "train.epochs=4",
    "train.num_workers=0",
    "train.tensorboard=false",
]


@pytest.mark.parametrize("model", ["mlp", "resnet18"])
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_default_recipe_learns_on_any_number_of_processes(tmp_path, model, nproc):
    args = [*SMALL_DEFAULT_RUN, f"model.name={model}", f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=nproc, timeout=600, cwd=PROJECT)
    expected_lr = 0.2 * 32 * nproc / 128
    assert f"lr {expected_lr:.4g} = train.lr 0.2 scaled from batch 128 to 32x{nproc}x1" in result.stdout
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(row["train_loss"]) for row in metrics)
    assert metrics[-1]["train_loss"] < 0.7 * metrics[0]["train_loss"]
    assert metrics[-1]["val_acc"] > 0.5, metrics  # 10 classes: chance is 0.1
