"""The EMA of the weights (ema.decay): its rule, a bitwise resume under DDP and FSDP,
its metrics beside the model's, best.pt following them, and evaluate.py --weights ema."""

import json

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from conftest import FAST, STRATEGIES, read_metrics, reference_config, run_script, strategy_args, tensors
from engine.checkpoint import load_checkpoint
from engine.errors import ConfigError
from engine.parts.ema import WeightEMA

STEPS_PER_EPOCH = 256 // (16 * 2)
ARGS = [
    *FAST,
    "data.train_size=256",
    "train.epochs=3",
    "ema.decay=0.75",
    "ema.start_step=3",
    "checkpoint.best_metric=ema_val_loss",  # best.pt follows the EMA
    "checkpoint.best_mode=min",
]


def test_the_average_copies_the_weights_through_the_first_update_after_the_start_step_then_decays():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = WeightEMA(decay=0.75, start_step=2).attach(model)
    for step in range(1, 5):
        before = {name: tensor.clone() for name, tensor in ema.weights().items()}
        with torch.no_grad():
            for tensor in (*model.parameters(), model[1].running_mean):
                tensor.add_(float(step))
            model[1].num_batches_tracked += 1
        ema.update(step)
        for name, weight in model.state_dict().items():
            if step <= 3 or not weight.is_floating_point():  # copied through step 3, and the batch count always
                expected = weight
            else:
                expected = 0.75 * before[name] + 0.25 * weight
            assert torch.allclose(ema.weights()[name], expected), (step, name)
    kept = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    average = {name: tensor.clone() for name, tensor in ema.weights().items()}
    with ema.swapped_into_model():
        assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in average.items())
        assert not torch.equal(model[0].weight, kept["0.weight"])
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in kept.items())  # back, exactly


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resumed_run_ends_with_the_same_average_and_reports_and_evaluates_it(tmp_path, strategy):
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = [*ARGS, *strategy_args(strategy)]
    run_script("train.py", [*args, f"output_dir={whole}"], nproc=2)
    run_script("train.py", [*args, f"output_dir={split}", f"train.stop_at_step={STEPS_PER_EPOCH + 3}"], nproc=2)
    assert "resumed from" in run_script("train.py", [*args, f"output_dir={split}"], nproc=2).stdout

    a, b = (load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split))
    for part in ("model", "ema"):
        assert tensors(a[part]).keys() == tensors(b[part]).keys()
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert any(not torch.equal(a["ema"][key], a["model"][key]) for key in a["model"])  # it is an average

    rows = read_metrics(whole)
    ema_losses = [row["ema_val_loss"] for row in rows]
    assert [row["ema_val_loss"] for row in read_metrics(split)] == ema_losses
    assert ema_losses != [row["val_loss"] for row in rows]
    best = load_checkpoint(whole / "checkpoints" / "best.pt")
    assert best["step"] == rows[ema_losses.index(min(ema_losses))]["step"]  # best.pt by ema_val_loss

    # evaluate.py on another number of processes gives the training run's figures exactly.
    last = str(whole / "checkpoints" / "last.pt")
    for flag, prefix, nproc in ((["--weights", "ema"], "ema_", 3), ([], "", None)):
        printed = run_script("evaluate.py", ["--checkpoint", last, *flag], nproc=nproc).stdout.splitlines()[-1]
        expected = {"val_loss": rows[-1][f"{prefix}val_loss"], "weights": "ema" if flag else "model"}
        assert json.loads(printed) | expected == json.loads(printed)


def test_tied_weights_are_averaged_once_and_saved_under_each_name():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    model[1].weight = model[0].weight  # tied, as an embedding and its output layer
    ema = WeightEMA(decay=0.5, start_step=0).attach(model)
    ema.update(1)  # the first update copies the weights
    with torch.no_grad():
        model[0].weight.add_(2.0)
    before = ema.weights()["0.weight"].clone()
    ema.update(2)
    assert list(ema.weights()) == ["0.weight", "1.weight"] and ema.weights()["1.weight"] is ema.weights()["0.weight"]
    assert torch.allclose(ema.weights()["0.weight"], 0.5 * before + 0.5 * model[0].weight)
    kept, average = model[0].weight.detach().clone(), ema.averages["0.weight"].clone()
    with ema.swapped_into_model():
        assert torch.equal(model[1].weight, average)  # swapped once, not twice
    assert torch.equal(model[0].weight, kept)


def test_fine_tuning_starts_the_average_from_the_loaded_weights(tmp_path):
    """init_from (and a checkpoint without an EMA) loads weights after the EMA was made: the
    first update copies the weights trained from them, not the fresh model's."""
    run_script("train.py", [*FAST, "train.stop_at_step=8", f"output_dir={tmp_path / 'source'}"])
    source = tmp_path / "source" / "checkpoints" / "last.pt"
    args = [*ARGS, "ema.decay=0.999999", "ema.start_step=0", "train.stop_at_step=1"]
    run_script(
        "train.py",
        [*args, "checkpoint.resume=none", f"checkpoint.init_from={source}", f"output_dir={tmp_path / 'tuned'}"],
    )
    loaded = load_checkpoint(source)["model"]
    tuned = load_checkpoint(tmp_path / "tuned" / "checkpoints" / "last.pt")
    for key, value in loaded.items():
        assert torch.equal(tuned["ema"][key], tuned["model"][key]), key
        assert torch.allclose(tuned["ema"][key].float(), value.float(), atol=1e-2), key  # one step from them


def test_an_update_period_averages_every_nth_step_only():
    model = nn.Linear(2, 1)
    ema = WeightEMA(decay=0.5, every_steps=3).attach(model)
    for step in range(1, 8):
        before = ema.weights()["weight"].clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        ema.update(step)
        # Updates at steps 1, 4, 7 (the 1st, 4th, ... step): the first copies the weights.
        expected = {1: model.weight, 4: 0.5 * before + 0.5 * model.weight, 7: 0.5 * before + 0.5 * model.weight}
        assert torch.allclose(ema.weights()["weight"], expected.get(step, before)), step


class Steps:
    """A TrainState as WeightEMA.setup reads it."""

    def __init__(self, model, steps_per_epoch):
        self.model, self.steps_per_epoch = model, steps_per_epoch


@pytest.mark.parametrize(
    "steps_per_epoch, every, warmup_epochs", [(7, 3, 1), (8, 2, 2), (5, 1, 1), (6, 4, 0), (9, 32, 1)]
)
def test_the_settings_give_torchvisions_recipe_arithmetic(steps_per_epoch, every, warmup_epochs):
    """torchvision's classification recipe, by hand: after the optimizer step of batch i (from
    0 in each epoch), `if i % model_ema_steps == 0: update_parameters(model)`, and through
    epochs < lr_warmup_epochs `n_averaged.fill_(0)`, so that its next update copies. The
    same settings here must give the same average at every step, bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ours = WeightEMA(decay=0.9, every_steps=every, warmup_epochs=warmup_epochs)
    ours.setup(Steps(model, steps_per_epoch))
    for epoch in range(3):
        for i in range(steps_per_epoch):
            with torch.no_grad():
                for tensor in (*model.parameters(), model[1].running_mean):
                    tensor.add_(torch.randn_like(tensor))
            if i % every == 0:
                reference.update_parameters(model)
                if epoch < warmup_epochs:
                    reference.n_averaged.fill_(0)
            ours.update(epoch * steps_per_epoch + i + 1)
            expected = dict(reference.module.named_parameters()) | dict(reference.module.named_buffers())
            for name, tensor in ours.weights().items():
                if tensor.is_floating_point():
                    assert torch.equal(tensor, expected[name]), (epoch, i, name)


# torchvision's classification recipe: an update every 32 steps (here 2), its decay
# adjusted to the batch per step and the epochs, and the average starting after the warmup.
REFERENCE_STYLE = ["ema.decay=0.99", "ema.adjust=true", "ema.every_steps=2", "ema.warmup_epochs=1"]


def test_the_reference_settings_average_alike_on_1_and_2_processes_at_equal_effective_batch(tmp_path):
    """The same samples per step (32 = 32 x 1 = 16 x 2): the same decay, the same start, and
    averages equal to float rounding (the processes' gradients are summed in another order)."""
    args = [*FAST, "data.train_size=256", "train.epochs=3", *REFERENCE_STYLE]
    lines, checkpoints = [], []
    for nproc, batch_size in ((1, 32), (2, 16)):
        out = tmp_path / f"n{nproc}"
        result = run_script("train.py", [*args, f"train.batch_size={batch_size}", f"output_dir={out}"], nproc=nproc)
        lines += [line for line in result.stdout.splitlines() if line.startswith("ema: decay")]
        checkpoints.append(load_checkpoint(out / "checkpoints" / "last.pt"))
    # 1 - (1 - 0.99) x 32 x 2 / 3 epochs, copying through the first step of epoch 2 (8 steps of 32 samples);
    # one line per run, whatever its processes
    line = "ema: decay 0.786667 every 2 optimizer step(s) of each epoch, copying the weights to step 9"
    assert lines == [line, line]
    one, two = (tensors(c["ema"]) for c in checkpoints)
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        assert torch.allclose(tensor, two[name], rtol=1e-4, atol=1e-6), name
    moved = tensors(checkpoints[0]["model"])
    assert any(not torch.equal(moved[name], tensor) for name, tensor in one.items())  # an average, not the weights


def test_a_warmup_too_long_to_count_in_steps_is_one_line():
    with pytest.raises(ConfigError) as error:
        reference_config(None, ["ema.warmup_epochs=1e308"])
    assert str(error.value) == "ema.warmup_epochs must be at most 1e+06, got 1e+308"
