"""Stop cleanly when asked: SIGTERM (torchrun, SLURM, Kubernetes), SIGINT (Ctrl-C) or
SIGUSR1 (SLURM's `--signal` warning before the time limit).

A signal may reach one process or all of them. Each process only notes it; at agreed
optimizer steps all ranks compare notes (one tiny all-reduce) and stop together, so rank
0 writes a step checkpoint that the next run resumes from exactly. torchrun kills workers
30 s after its SIGTERM, so stopping must take well under that: under a second plus one
step and one save.
"""

import datetime
import signal
import time

import torch
import torch.distributed as dist

from engine.distributed import get_world_size, is_main

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
CHECK_EVERY_SECONDS = 0.5  # how often ranks compare notes: a few hundred us each time


class StopRequest:
    """When to stop before the last epoch ends: on a stop signal to any rank, or at
    train.stop_at_step. `requested(step)` says it identically on every rank."""

    def __init__(self, timeout_minutes: float, stop_at_step: int = 0):
        self.stop_at_step = stop_at_step  # 0: none
        self.signal_name = ""
        # Notes travel over a separate CPU (gloo) group, so comparing them never waits
        # for the GPU.
        self.group = None
        if get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
        self.next_check_step = 0
        self.last_check = None  # (step, time) of the previous comparison

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signal_name = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """Whether to stop after optimizer step `step`. Every rank must call this after
        every step."""
        return self.agreed(step) or step == self.stop_at_step

    def reason(self, step: int) -> str:
        if step == self.stop_at_step and not self.signal_name:
            return "at train.stop_at_step"
        return f"by {self.signal_name or 'a signal to another process'}"

    def agreed(self, step: int) -> bool:
        """Whether any rank got a stop signal. Every rank must call this after every step.

        Ranks compare notes only every ~CHECK_EVERY_SECONDS: rank 0 proposes the next
        step to compare at from its step rate, inside the same all-reduce, so every rank
        knows it and no clock has to agree.
        """
        if self.group is None:
            return bool(self.signal_name)
        if step < self.next_check_step:
            return False
        now = time.monotonic()
        if self.last_check is None:  # the first step of this run: no rate known yet
            proposal = step + 1
        else:
            last_step, last_time = self.last_check
            steps_per_second = (step - last_step) / max(now - last_time, 1e-6)
            proposal = step + max(1, int(steps_per_second * CHECK_EVERY_SECONDS))
        proposal = proposal if is_main() else 0
        notes = torch.tensor([1.0 if self.signal_name else 0.0, float(proposal)], dtype=torch.float64)
        dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.group)
        self.next_check_step = int(notes[1].item())
        self.last_check = (step, now)
        return bool(notes[0].item())
