"""The default recipe (recipe.py as generated, frozen in tests/reference_task): optim.lr
scaled to the effective batch, warmup in epochs."""

from itertools import pairwise

import pytest
import torch

from conftest import FAST, read_metrics, reference_config, reference_task, run_script

RECIPE = reference_task().recipe


@pytest.mark.parametrize(
    "overrides, world_size, expected",
    [
        ([], 2, 0.2),  # 64 x 2 = 128: the reference batch itself
        ([], 4, 0.4),  # twice the batch, twice the rate
        (["train.batch_size=16", "train.accum_steps=4"], 8, 0.8),  # 512 samples per step
        (["optim.name=adamw", "optim.lr=0.001"], 8, 0.002),  # 512 = 4 x 128: square root
        (["optim.scale_lr=false", "optim.lr=0.3"], 8, 0.3),
        (["optim.reference_batch=256"], 1, 0.05),
    ],
)
def test_lr_scales_with_the_effective_batch(overrides, world_size, expected):
    cfg = reference_config(None, overrides)
    assert RECIPE.scaled_lr(cfg, world_size) == pytest.approx(expected)


def test_the_log_line_shows_how_the_lr_was_derived():
    cfg = reference_config(None, ["train.batch_size=32", "optim.warmup_epochs=0.5"])
    line = RECIPE.describe(cfg, world_size=2, steps_per_epoch=40)
    assert line.startswith("lr 0.1 = optim.lr 0.2 scaled from batch 128 to 32x2x1 (linear rule;")
    assert "warmup 20 steps" in line
    as_is = RECIPE.describe(reference_config(None, ["optim.scale_lr=false"]), world_size=2, steps_per_epoch=40)
    assert as_is == "lr 0.2; set at every optimizer step: warmup 40 steps (linear from lr/40), then the cosine schedule"
    few = RECIPE.describe(cfg, world_size=2, steps_per_epoch=4)
    assert few.endswith("; only 4 steps per epoch: a smaller effective batch or more epochs train better")


@pytest.mark.parametrize("steps_per_epoch", [3, 40, 1000])
def test_warmup_is_measured_in_epochs(steps_per_epoch):
    cfg = reference_config(None, ["train.epochs=5", "optim.warmup_epochs=1.5"])
    warmup = RECIPE.warmup_steps(cfg.optim, steps_per_epoch)
    assert warmup == round(1.5 * steps_per_epoch)
    factors = [RECIPE.lr_factor(step, cfg, steps_per_epoch) for step in range(5 * steps_per_epoch)]
    assert factors[0] == pytest.approx(1 / warmup) and factors[warmup - 1] == 1.0
    assert all(a < b for a, b in pairwise(factors[:warmup]))  # rises through warmup
    assert all(a >= b for a, b in pairwise(factors[warmup:]))  # then decays
    assert factors[-1] < 0.05  # cosine to near zero by the last step


@pytest.mark.parametrize("steps_per_epoch", [40, None], ids=["map-style", "stream"])
def test_a_run_counted_in_steps_warms_up_and_decays_over_its_steps(steps_per_epoch):
    cfg = reference_config(None, ["train.max_steps=300", "optim.warmup_steps=30", "train.epochs=2"])
    factors = [RECIPE.lr_factor(step, cfg, steps_per_epoch) for step in range(300)]
    assert RECIPE.warmup_steps(cfg.optim, steps_per_epoch) == 30 and factors[29] == 1.0
    assert all(a >= b for a, b in pairwise(factors[30:]))  # decays over the 300 steps, not 2 epochs of 40
    assert factors[79] > 0.9 and factors[-1] < 0.001


def test_scheduler_starts_at_the_warmup_rate():
    cfg = reference_config(None, ["optim.warmup_epochs=2"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduler = RECIPE.build_scheduler(optimizer, cfg, steps_per_epoch=10)
    assert scheduler.get_last_lr()[0] == pytest.approx(0.4 / 20)


def test_a_checkpoint_config_with_a_retired_key_still_loads():
    """Configs stored in checkpoints by an older engine (warmup was in steps, the optimizer's
    settings in train) evaluate; so do those with sections of parts this project lacks."""
    stored = reference_config(None, ["train.epochs=3"]).to_dict()
    stored["train"] |= {"warmup_steps": 100, "lr": 0.5}
    stored["swa"] = {"decay": 0.5}
    cfg = reference_config(None, base=stored)
    assert cfg.train.epochs == 3 and not hasattr(cfg.train, "warmup_steps") and not hasattr(cfg.train, "lr")
    assert not hasattr(cfg, "swa") and cfg.optim.lr == 0.2


def test_each_metrics_row_gives_the_rate_its_last_step_used(tmp_path):
    """A per-epoch schedule: epoch 0's steps use the base lr, epoch 1's a tenth of it. The
    row of epoch 0 gives epoch 0's rate, not the next epoch's."""
    schedule = ["optim.schedule=step", "optim.step_every_epochs=1", "optim.step_gamma=0.1", "optim.warmup_epochs=0"]
    args = [*FAST, "data.train_size=64", "train.epochs=2", "optim.scale_lr=false", *schedule]
    run_script("train.py", [*args, f"output_dir={tmp_path}"])
    assert [row["lr"] for row in read_metrics(tmp_path)] == pytest.approx([0.1, 0.01])
