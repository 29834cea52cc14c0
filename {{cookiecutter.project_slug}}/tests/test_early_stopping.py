"""Early stopping on checkpoint.best_metric, with real 2-process runs."""

import pytest

from conftest import FAST, read_metrics, reference_config, run_script
from engine.distributed import DistEnv
from engine.parts import early_stopping
from engine.training import TrainState

EPOCHS = 8
ARGS = [
    *FAST,
    f"train.epochs={EPOCHS}",
    "data.train_size=256",
    "checkpoint.best_metric=val_loss",
    "checkpoint.best_mode=min",
]
STEPS_PER_EPOCH = 256 // (16 * 2)


def stopping_epoch(values: list[float], patience: int, min_delta: float) -> int | None:
    """The rule, written out independently: the epoch after which the run should end."""
    best, without = None, 0
    for epoch, value in enumerate(values):
        if best is None or best - value > min_delta:
            best, without = value, 0
        else:
            without += 1
        if without >= patience:
            return epoch
    return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run without early stopping: its val_loss curve says where to stop."""
    out = tmp_path_factory.mktemp("reference")
    run_script("train.py", [*ARGS, f"output_dir={out}"], nproc=2)
    return [row["val_loss"] for row in read_metrics(out)]


def test_the_run_ends_at_the_epoch_the_rule_gives_and_a_resume_keeps_its_count(tmp_path, reference):
    gains = [before - after for before, after in zip(reference, reference[1:], strict=False)]
    patience, min_delta = 2, sorted(gains)[-3] / 2  # half the third-largest gain: later, smaller ones do not count
    expected = stopping_epoch(reference, patience, min_delta)
    assert expected is not None and expected < EPOCHS - 1, (reference, min_delta)  # the setup stops early
    args = [*ARGS, f"early_stopping.patience={patience}", f"early_stopping.min_delta={min_delta!r}"]
    args.append(f"output_dir={tmp_path}")
    # Stopped mid-epoch one epoch before the end, once the count has started: resumed, it goes on.
    run_script("train.py", [*args, f"train.stop_at_step={expected * STEPS_PER_EPOCH - 3}"], nproc=2)
    finished = run_script("train.py", args, nproc=2)
    line = next(line for line in finished.stdout.splitlines() if "early stop" in line)
    best = min(reference[: expected + 1])
    assert line == (
        f"early stop after epoch {expected}: val_loss has not improved by more than {min_delta:g} for {patience} "
        f"epochs; the best, {best:.6g}, is in {tmp_path / 'checkpoints' / 'best.pt'}"
    )
    rows = read_metrics(tmp_path)
    assert [row["epoch"] for row in rows] == list(range(expected + 1))
    assert [row["val_loss"] for row in rows] == reference[: expected + 1]  # the same run, cut short

    again = run_script("train.py", args, nproc=2)  # a requeue after the stop: nothing more to train
    assert line in again.stdout and len(read_metrics(tmp_path)) == expected + 1


def test_off_by_default_and_each_epoch_counts_alike_on_every_rank():
    assert early_stopping.build(reference_config(), DistEnv()) is None  # off: no part, no hook
    overrides = ["early_stopping.patience=2", "early_stopping.min_delta=0.1", "checkpoint.best_metric=val_acc"]
    rule = early_stopping.build(reference_config(None, [*overrides, "checkpoint.best_mode=max"]), DistEnv())
    state = TrainState(*[None] * 7, epoch=5, best_metric_value=0.65)
    for value in (0.5, 0.55, 0.65, 0.7):  # +0.05 does not count; +0.15 over the best does; +0.05 does not
        rule.after_evaluation(state, {"val_acc": value})
    assert (rule.best, rule.epochs_without_improvement, rule.stop_reason(state)) == (0.65, 1, None)
    rule.after_evaluation(state, {"val_acc": 0.74})
    assert rule.stop_reason(state).startswith("early stop after epoch 4: val_acc has not improved by more than 0.1")
