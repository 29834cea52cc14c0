"""What the run tells people: console lines, progress, metrics.jsonl and TensorBoard.

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
    """Print once, from rank 0 (above the progress bar, if one is showing)."""
    if is_main():
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


class Progress:
    """Rank 0's progress for one epoch: a tqdm bar on a terminal, plain lines otherwise,
    and the step curves in TensorBoard.

    The loss is read (a host-device sync) only every `every` steps.
    """

    def __init__(
        self, epoch: int, total_steps: int, done_steps: int, every: int, samples_per_step: int, tensorboard_log
    ):
        self.epoch, self.every, self.samples_per_step = epoch, every, samples_per_step
        self.tensorboard_log = tensorboard_log
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch}", dynamic_ncols=True)
        self.last_time, self.steps_since_report = time.perf_counter(), 0

    def step(self, step: int, loss, lr: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
        self.steps_since_report += 1
        if step % self.every:
            return
        loss = loss.item()  # waits for the device, so the clock below times finished steps
        now = time.perf_counter()
        samples_per_s = self.steps_since_report * self.samples_per_step / max(now - self.last_time, 1e-9)
        self.last_time, self.steps_since_report = now, 0
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{samples_per_s:.0f}")
        else:
            print(
                f"epoch {self.epoch} step {step} loss {loss:.4f} lr {lr:.4g} samples/s {samples_per_s:.0f}",
                flush=True,
            )
        scalars = {"train/loss": loss, "train/lr": lr, "train/samples_per_s": samples_per_s}
        self.tensorboard_log.add_scalars(step, scalars)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoProgress:
    def step(self, step, loss, lr) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(epoch: int, total_steps: int, done_steps: int, every: int, samples_per_step: int, tensorboard_log):
    """`samples_per_step` is the effective batch (batch_size x processes x accum_steps)."""
    if not is_main():
        return NoProgress()
    return Progress(epoch, total_steps, done_steps, every, samples_per_step, tensorboard_log)


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


class TensorBoardLog:
    """Curves for TensorBoard in <output_dir>/tensorboard, against the optimizer step.

    A resumed run adds an events file to the same folder.
    """

    def __init__(self, writer):
        self.writer = writer

    def add_scalars(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def write_epoch(self, metrics: dict) -> None:
        self.add_scalars(metrics["step"], epoch_scalars(metrics))
        self.writer.flush()  # the epoch's curves show up now, not minutes later

    def close(self) -> None:
        self.writer.close()


class NoTensorBoardLog:
    def add_scalars(self, step: int, scalars: dict) -> None:
        pass

    def write_epoch(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def epoch_scalars(metrics: dict) -> dict:
    """TensorBoard tags for one epoch's metrics (as in metrics.jsonl). Memory: rank 0's
    figure and the largest over the ranks (`..._max`)."""
    scalars = {
        "train/epoch_loss": metrics["train_loss"],
        "val/loss": metrics["val_loss"],
        "val/acc": metrics["val_acc"],
        "throughput/samples_per_s": metrics["samples_per_s"],
    }
    per_rank = metrics["memory"]
    for key in ("rss_peak_mib", "cuda_reserved_peak_mib"):
        if key in per_rank[0]:
            scalars[f"memory/{key}"] = per_rank[0][key]
            scalars[f"memory/{key}_max"] = max(row[key] for row in per_rank)
    return scalars


def make_tensorboard_log(output_dir: str, enabled: bool, start_step: int):
    """Rank 0's TensorBoard log when `enabled` and the package is installed; otherwise a
    stand-in that writes nothing (metrics.jsonl has the same epoch figures)."""
    if not (enabled and is_main()):
        return NoTensorBoardLog()
    try:
        from torch.utils.tensorboard import SummaryWriter  # here: optional, and slow to import
    except ImportError as error:
        log(
            f"warning: train.tensorboard is on but tensorboard cannot be imported ({last_line(error)}); logging to "
            'metrics.jsonl only. Install it with pip install -e ".[tensorboard]" or set train.tensorboard=false'
        )
        return NoTensorBoardLog()
    # After a restart from an older checkpoint, TensorBoard hides the earlier run's points
    # beyond `start_step`: they were trained again.
    return TensorBoardLog(SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1))


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
