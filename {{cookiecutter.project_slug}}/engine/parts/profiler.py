"""Profiling: a few optimizer steps recorded with torch.profiler, into a trace that
TensorBoard's profiler plugin and Perfetto (ui.perfetto.dev) open.

It hangs on the optimizer (a step hook), so the training loop does not change, and it
costs nothing outside the steps it records. The run goes on normally.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from engine.config import check_positive
from engine.logs import log
from engine.parts import Part


@dataclass
class Section:
    steps: int = 0  # record this many optimizer steps with torch.profiler into output_dir/profile; 0 = off
    start_step: int = 5  # the first step recorded (after the first steps' one-time work)
    all_ranks: bool = False  # profile every rank, not rank 0 only

    def __post_init__(self):
        check_positive("profiler.steps", self.steps, allow_zero=True)
        check_positive("profiler.start_step", self.start_step)


def build(cfg, env) -> "Profiler | None":
    if not cfg.profiler.steps or not (env.rank == 0 or cfg.profiler.all_ranks):
        return None
    return Profiler(cfg.profiler, env.rank, cfg.output_dir)


class Profiler(Part):
    name = "profiler"

    def __init__(self, section: Section, rank: int, output_dir: str):
        self.section, self.rank, self.output_dir = section, rank, output_dir

    def start(self, state) -> None:
        profile_steps(state.optimizer, self.section, self.rank, state.step, self.output_dir)


def profile_steps(optimizer: torch.optim.Optimizer, section: Section, rank: int, step: int, output_dir: str):
    """Record optimizer steps profiler.start_step to profiler.start_step + profiler.steps - 1
    (numbered as in the log) on rank 0, or on every rank with profiler.all_ranks, into
    output_dir/profile. `step` is the run's step now (after a resume). Returns the profiler,
    or None when there is nothing to record."""
    first, count = section.start_step, section.steps
    before = first - step - 1  # profiler steps before the first recorded one
    if before < 0:
        if rank == 0:
            log(f"profiling skipped: the run resumes at step {step}, after profiler.start_step={first}")
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
