"""The non-finite guard's decisions, step by step, in one process (the real runs that
diverge are in test_faults.py)."""

import pytest
import torch

from conftest import reference_config, reference_task
from engine.checkpoint import Checkpointer
from engine.distributed import DistEnv
from engine.training import (
    MIN_FP16_SCALE,
    DivergedError,
    LaggedValue,
    NonFiniteGuard,
    TrainState,
    optimizer_step,
)

CPU = torch.device("cpu")


def make_state(tmp_path, precision="fp32", *overrides):
    cfg = reference_config(None, ["train.grad_clip=0", f"output_dir={tmp_path}", *overrides])
    model = torch.nn.Linear(3, 2)
    recipe = reference_task().recipe
    optimizer = recipe.build_optimizer(model, cfg, 1, {})
    scheduler = recipe.build_scheduler(optimizer, cfg, steps_per_epoch=10)
    # An enabled scaler stands for fp16 on CUDA: on the CPU it skips and rescales alike.
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    last_good = Checkpointer(cfg, DistEnv(), CPU).last_good  # cfg's output_dir: none saved there
    guard = NonFiniteGuard(cfg.train, last_good, lr=0.1, device=CPU)
    return TrainState(model, model, optimizer, scheduler, scaler, guard, CPU), cfg


def backward(state, value: float):
    loss = state.model(torch.full((1, 3), value)).sum()
    state.scaler.scale(loss).backward()


def test_a_non_finite_step_is_recorded_without_a_host_sync_then_stops_the_run(tmp_path):
    state, cfg = make_state(tmp_path)
    backward(state, 1.0)
    optimizer_step(state, cfg.train)
    state.guard.check(state.scaler)  # finite so far
    backward(state, float("nan"))
    optimizer_step(state, cfg.train)
    backward(state, float("inf"))
    optimizer_step(state, cfg.train)
    with pytest.raises(DivergedError, match=r"non-finite gradients at step 2; no checkpoint was saved before it"):
        state.guard.check(state.scaler)


def test_the_check_at_log_intervals_stops_the_run_one_interval_later(tmp_path):
    state, cfg = make_state(tmp_path)
    backward(state, 1.0)
    optimizer_step(state, cfg.train)
    state.guard.check_later()
    backward(state, float("nan"))
    optimizer_step(state, cfg.train)  # step 2
    state.guard.check_later()  # reads what the call before started: all finite then
    backward(state, 1.0)
    optimizer_step(state, cfg.train)
    with pytest.raises(DivergedError, match=r"non-finite gradients at step 2;"):
        state.guard.check_later()


def test_the_check_before_a_save_reads_at_once(tmp_path):
    state, cfg = make_state(tmp_path)
    backward(state, float("nan"))
    optimizer_step(state, cfg.train)
    state.guard.check_later()  # started reading, not read
    with pytest.raises(DivergedError, match=r"non-finite gradients at step 1;"):
        state.guard.check(state.scaler)


def test_a_lagged_value_is_the_one_given_the_call_before():
    lagged = LaggedValue()
    given = [torch.tensor(v) for v in (3, -1, 7)]
    assert [lagged.swap(t) for t in given] == [None, 3, -1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_check_at_log_intervals_never_waits_for_the_gpu(tmp_path):
    cfg = reference_config(None, [f"output_dir={tmp_path}"])
    gpu = torch.device("cuda", torch.cuda.current_device())
    guard = NonFiniteGuard(cfg.train, lambda: "none saved", lr=0.1, device=gpu)
    torch.cuda.set_sync_debug_mode("error")  # any op that waits for the GPU raises
    try:
        for step in range(1, 203):  # the checks every 50 steps read step 5 at step 100
            guard.skip_step(torch.tensor(float("nan") if step == 5 else 1.0, device=gpu), step)
            if step % 50 == 0:
                try:
                    guard.check_later()
                except DivergedError as error:
                    assert step >= 100 and "at step 5;" in str(error)  # read one interval later
                    return
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pytest.fail("the non-finite step was never reported")


RUN = range(1, 208)  # a run of 207 steps: bad ones at its start, middle and end
RESUMED = [*range(1, 30), *range(500, 540)]  # a gap in the steps the guard is given


@pytest.mark.parametrize(
    "steps, bad, first",
    [
        (RUN, {1}, 1),  # the first step
        (RUN, {100, 101}, 100),  # two in a row
        (RUN, {3, 202}, 3),  # the first is kept, however many steps later another comes
        (RUN, {207}, 207),  # the last
        (RESUMED, {29}, 29),  # just before the gap
        (RESUMED, {500, 520}, 500),  # just after it
        (RUN, set(), None),
    ],
)
def test_the_first_non_finite_step_is_named_among_many(tmp_path, steps, bad, first):
    state, _ = make_state(tmp_path)
    for step in steps:
        norm = float("inf") if step % 2 else float("nan")
        state.guard.skip_step(torch.tensor(norm if step in bad else 1.0), step)
    if first is None:
        state.guard.check(state.scaler)
        state.guard.check(state.scaler)  # twice: nothing is left over from the first
        return
    for _ in range(2):  # and the step is named again by a later check
        with pytest.raises(DivergedError, match=rf"non-finite gradients at step {first};"):
            state.guard.check(state.scaler)


def test_max_bad_steps_skips_the_update_then_stops(tmp_path):
    state, cfg = make_state(tmp_path, "fp32", "train.max_bad_steps=1")
    backward(state, float("nan"))
    before = state.model.weight.detach().clone()
    optimizer_step(state, cfg.train)
    assert torch.equal(state.model.weight, before) and state.guard.skipped_steps == 1 and state.step == 1
    assert state.state_dict()["skipped_steps"] == 1  # a resumed run counts on
    backward(state, float("nan"))
    with pytest.raises(DivergedError, match=r"at step 2, after 1 skipped \(train.max_bad_steps\)"):
        optimizer_step(state, cfg.train)


def test_fp16_steps_the_scaler_skips_are_normal_until_its_scale_collapses(tmp_path):
    state, cfg = make_state(tmp_path, "fp16")
    for _ in range(5):
        backward(state, float("inf"))
        optimizer_step(state, cfg.train)
    assert torch.isfinite(state.model.weight).all()  # the scaler skipped them
    state.guard.check(state.scaler)  # and the guard lets it
    state.scaler.update(MIN_FP16_SCALE / 2)
    with pytest.raises(DivergedError, match="fp16 loss scale fell below"):
        state.guard.check(state.scaler)
