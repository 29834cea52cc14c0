"""A few optimizer steps recorded with torch.profiler (for TensorBoard or ui.perfetto.dev), by a step hook."""

from dataclasses import dataclass
from pathlib import Path

from torch.profiler import profile, schedule, tensorboard_trace_handler

from engine.config import check_positive
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {f"train.profile_{key}": f"profiler.{key}" for key in ("steps", "start_step", "all_ranks")}


@dataclass
class Section:
    steps: int = 0  # record this many optimizer steps with torch.profiler into output_dir/profile; 0 = off
    start_step: int = 5  # the first step recorded (after the first steps' one-time work)
    all_ranks: bool = False  # profile every rank, not rank 0 only

    def __post_init__(self):
        check_positive("profiler.steps", self.steps, allow_zero=True)
        check_positive("profiler.start_step", self.start_step)


def build(cfg, env) -> "Profiler | None":
    on = cfg.profiler.steps and (env.rank == 0 or cfg.profiler.all_ranks)
    return Profiler(cfg.profiler, env.rank, cfg.output_dir) if on else None


class Profiler(Part):
    name = "profiler"

    def __init__(self, section: Section, rank: int, output_dir: str):
        self.first, self.count, self.rank = section.start_step, section.steps, rank
        self.trace = tensorboard_trace_handler(str(Path(output_dir) / "profile"), worker_name=f"rank{rank}")

    def start(self, state) -> None:
        before = self.first - state.step - 1  # profiler steps before the first recorded one
        if before < 0:
            if self.rank == 0:
                log(f"profiling skipped: the run resumes at step {state.step}, after profiler.start_step={self.first}")
            return
        warmup = min(before, 1)  # a step to settle the profiler's own start, when there is one
        plan = schedule(wait=before - warmup, warmup=warmup, active=self.count, repeat=1)
        self.profiler = profile(schedule=plan, on_trace_ready=self.trace, record_shapes=True)  # CPU and accelerators
        self.profiler.start()
        self.remaining = before + self.count
        state.optimizer.register_step_post_hook(self.advance)

    def advance(self, *_) -> None:
        # Not removed when done, from inside: the optimizer is iterating over its hooks.
        if self.remaining > 0:
            self.profiler.step()
            self.remaining -= 1
            if self.remaining == 0:  # the trace is written now
                self.profiler.stop()
