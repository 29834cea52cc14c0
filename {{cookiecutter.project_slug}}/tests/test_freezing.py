"""freeze.params: frozen parameters stay as they are, freeze.epochs unfreezes them
(DDP wrapped again), and a resume across the unfreeze is bitwise."""

import pytest
import torch
import torch.nn as nn

from conftest import FAST, STRATEGIES, needs_fsdp, reference_config, reference_task, run_script, tensors
from engine.checkpoint import config_changes, load_checkpoint
from engine.distributed import DistEnv
from engine.errors import ConfigError
from engine.parts import freeze

RECIPE = reference_task().recipe
STEPS_PER_EPOCH = 256 // (16 * 2)
# The reference mlp: net.2 and net.3 are its hidden layers, net.4 the classifier.
ARGS = [
    *FAST,
    "data.train_size=256",
    "freeze.params=net.2,net.3",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=10",
]


def weights(output_dir, step: int, prefix: str) -> dict:
    folder = output_dir / "checkpoints"
    path = next(p for p in folder.iterdir() if p.name.startswith(f"step-{step:08d}"))
    return {key: value for key, value in load_checkpoint(path)["model"].items() if key.startswith(prefix)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_frozen_for_an_epoch_then_trained_and_a_resume_after_the_unfreeze_is_bitwise(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = [*ARGS, "train.epochs=3", "freeze.epochs=1"]
    out = run_script("train.py", [*args, f"output_dir={whole}"], nproc=2).stdout
    assert "epoch 1: the parameters of freeze.params are trained from here on" in out
    for prefix in ("net.2", "net.3"):  # frozen through epoch 0, trained after
        assert same(weights(whole, 4, prefix), weights(whole, STEPS_PER_EPOCH, prefix))
        assert not same(weights(whole, STEPS_PER_EPOCH, prefix), weights(whole, STEPS_PER_EPOCH + 4, prefix))
    assert not same(weights(whole, 4, "net.4"), weights(whole, STEPS_PER_EPOCH, "net.4"))

    # Stopped in epoch 1: the resumed run builds the model frozen and unfreezes it at once.
    run_script("train.py", [*args, f"output_dir={split}", f"train.stop_at_step={STEPS_PER_EPOCH + 4}"], nproc=2)
    run_script("train.py", [*args, f"output_dir={split}"], nproc=2)
    # Resumed from the end of the frozen epoch (a requeue between epochs): unfrozen only then.
    epoch_end = whole / "checkpoints" / f"step-{STEPS_PER_EPOCH:08d}.pt"
    assert load_checkpoint(epoch_end)["batches_done"] == 0
    between = tmp_path / "between"
    run_script("train.py", [*args, f"output_dir={between}", f"checkpoint.resume={epoch_end}"], nproc=2)
    a = load_checkpoint(whole / "checkpoints" / "last.pt")
    for other in (split, between):
        b = load_checkpoint(other / "checkpoints" / "last.pt")
        assert a["step"] == b["step"] == 3 * STEPS_PER_EPOCH
        for part in ("model", "optimizer"):
            for key, value in tensors(a[part]).items():
                assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume ({other.name})"


@needs_fsdp
def test_under_fsdp_frozen_parameters_stay_as_they_are_for_the_whole_run(tmp_path):
    run_script("train.py", [*ARGS, "train.epochs=1", "fsdp.enabled=true", f"output_dir={tmp_path}"], nproc=2)
    assert same(weights(tmp_path, 4, "net.2"), weights(tmp_path, STEPS_PER_EPOCH, "net.2"))
    assert not same(weights(tmp_path, 4, "net.4"), weights(tmp_path, STEPS_PER_EPOCH, "net.4"))


def freezing(params: str, *overrides) -> freeze.Freezing:
    return freeze.build(reference_config(None, [f"freeze.params={params}", *overrides]), DistEnv())


def test_a_prefix_that_names_no_parameter_is_a_config_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(ConfigError) as error:
        freezing("0,backbone").prepare_model(model)
    assert str(error.value) == (
        "freeze.params: 'backbone' starts no parameter name of the model; its names start with 0, 1 "
        "(see model.named_parameters())"
    )
    assert [p.requires_grad for p in freezing("0").prepare_model(model).parameters()] == [False, False, True, True]
    if "fsdp" in STRATEGIES:  # a project without FSDP has no fsdp.enabled to set
        with pytest.raises(ConfigError, match="freeze.epochs needs DDP"):
            freezing("0", "freeze.epochs=1", "fsdp.enabled=true")
    with pytest.raises(ConfigError, match="freeze.epochs is set but freeze.params names no parameters"):
        reference_config(None, ["freeze.epochs=1"])


def test_unfrozen_parameters_warm_up_again_from_the_unfreeze():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    overrides = ["freeze.epochs=2", "optim.warmup_epochs=1", "train.epochs=4", "optim.scale_lr=false", "optim.lr=1"]
    cfg, part, recipe = reference_config(None, ["freeze.params=0", *overrides]), freezing("0", *overrides), RECIPE
    model = part.prepare_model(model)
    optimizer = recipe.build_optimizer(model, cfg, 1, part.joins_later(model, steps_per_epoch=4))
    scheduler = recipe.build_scheduler(optimizer, cfg, steps_per_epoch=4)
    rates = []
    for _ in range(16):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert [len(group["params"]) for group in optimizer.param_groups] == [1, 1, 1, 1]  # 1's and 0's weight, bias
    for step, (now, _, later, _) in enumerate(rates):
        assert now == pytest.approx(recipe.lr_factor(step, cfg, 4))
        ramp = 0 if step < 8 else min(1, (step - 7) / 4)  # from the unfreeze at step 8, over an epoch
        assert later == pytest.approx(ramp * now)


def test_freeze_settings_cannot_change_on_resume():
    saved = reference_config(None, ["freeze.params=net.2", "freeze.epochs=1"]).to_dict()
    for overrides, change in (
        (["freeze.params=net.2"], "freeze.epochs: 1 -> 0"),
        (["freeze.params=net.3", "freeze.epochs=1"], "freeze.params: 'net.2' -> 'net.3'"),
    ):
        assert config_changes(saved, reference_config(None, overrides)) == [change]
    assert config_changes(saved, reference_config(None, ["freeze.params=net.2", "freeze.epochs=1"])) == []
