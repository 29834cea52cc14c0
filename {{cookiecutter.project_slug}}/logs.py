"""What the run tells people: console lines, progress, and metrics.jsonl.

Only rank 0 reports. Other ranks get no-op stand-ins with the same methods, so the
training loop has one shape and no rank checks of its own.
"""

import functools
import json
import re
import sys
import time
from pathlib import Path

import torch.distributed
from tqdm import tqdm

from config import UsageError
from distributed import PeerFailed, get_rank, is_main


def log(message: str) -> None:
    """Print once, from rank 0."""
    if is_main():
        print(message, flush=True)


class Progress:
    """Rank 0's progress for one epoch: a tqdm bar on a terminal, plain lines otherwise.

    The loss is read (a host-device sync) only every `every` steps.
    """

    def __init__(self, epoch: int, total_steps: int, done_steps: int, every: int):
        self.epoch, self.total, self.every = epoch, total_steps, every
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch}", dynamic_ncols=True)
        self.last_time, self.last_step = time.perf_counter(), None

    def step(self, step: int, loss, lr: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
        if step % self.every:
            return
        now = time.perf_counter()
        steps_per_s = (step - self.last_step) / (now - self.last_time) if self.last_step is not None else 0.0
        self.last_time, self.last_step = now, step
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.3g}", it_s=f"{steps_per_s:.2f}")
        else:
            print(
                f"epoch {self.epoch} step {step} loss {loss.item():.4f} lr {lr:.4g} steps/s {steps_per_s:.2f}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoProgress:
    def step(self, step, loss, lr) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(epoch: int, total_steps: int, done_steps: int, every: int):
    return Progress(epoch, total_steps, done_steps, every) if is_main() else NoProgress()


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (a resumed run continues it)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


class NoMetricsLog:
    def write(self, record: dict) -> None:
        pass


def make_metrics_log(output_dir: str):
    return MetricsLog(Path(output_dir) / "metrics.jsonl") if is_main() else NoMetricsLog()


def report_errors(main):
    """Turn expected failures into one line on rank 0 instead of a traceback per rank:
    bad input (UsageError: config, data, checkpoint) exits 2; a lost peer process exits 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UsageError as error:
            # Errors every rank raises alike are shown by rank 0; an error raised on one
            # rank only is shown by that rank; PeerFailed ranks stay quiet.
            if not isinstance(error, PeerFailed) and (is_main() or getattr(error, "local", False)):
                prefix = "" if is_main() else f"rank {get_rank()}: "
                print(f"error: {prefix}{last_line(error)}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except RuntimeError as error:
            if not lost_peer(error):
                raise
            # Every survivor says it: rank 0 may be the process that died.
            print(
                f"rank {get_rank()} stopped: lost contact with another process: it crashed, was killed, "
                f"or hung longer than dist.timeout_minutes (see its output). {last_line(error)}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None

    return wrapper


def lost_peer(error: RuntimeError) -> bool:
    """A collective failed because another process died or stopped answering. gloo
    reports this as a plain RuntimeError, so its messages are recognised too."""
    if isinstance(error, (torch.distributed.DistNetworkError, torch.distributed.DistStoreError)):
        return True
    return bool(re.search(r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe", str(error)))


def last_line(error: Exception) -> str:
    """The message itself; errors re-raised from DataLoader workers carry the worker's
    traceback in front of it."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(rf"^[\w.]*{type(error).__name__}: ", "", lines[-1])
