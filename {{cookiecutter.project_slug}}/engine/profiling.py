"""Profiling: a few optimizer steps recorded with torch.profiler, into a trace that
TensorBoard's profiler plugin and Perfetto (ui.perfetto.dev) open.

It hangs on the optimizer (a step hook), so the training loop does not change, and it
costs nothing outside the steps it records. The run goes on normally.
"""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from engine.config import TrainConfig
from engine.logs import log


def profile_steps(optimizer: torch.optim.Optimizer, train: TrainConfig, rank: int, step: int, output_dir: str):
    """Record optimizer steps train.profile_start_step to train.profile_start_step +
    train.profile_steps - 1 (numbered as in the log) on rank 0, or on every rank with
    train.profile_all_ranks, into output_dir/profile. `step` is the run's step now (after
    a resume). Returns the profiler, or None when there is nothing to record."""
    first, count = train.profile_start_step, train.profile_steps
    if not count or not (rank == 0 or train.profile_all_ranks):
        return None
    before = first - step - 1  # profiler steps before the first recorded one
    if before < 0:
        if rank == 0:
            log(f"profiling skipped: the run resumes at step {step}, after train.profile_start_step={first}")
        return None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    warmup = min(before, 1)  # a step to settle the profiler's own start, when there is one
    profiler = profile(
        activities=activities,
        schedule=schedule(wait=before - warmup, warmup=warmup, active=count, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(Path(output_dir) / "profile"), worker_name=f"rank{rank}"),
        record_shapes=True,
    )
    profiler.start()
    remaining = before + count

    def advance(*_) -> None:
        # Not removed from inside: the optimizer is iterating over its hooks.
        nonlocal remaining
        if remaining > 0:
            profiler.step()
            remaining -= 1
            if remaining == 0:  # the trace is written now
                profiler.stop()

    optimizer.register_step_post_hook(advance)
    return profiler
