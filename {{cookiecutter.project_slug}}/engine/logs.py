"""What the run tells people: console lines, progress, metrics.jsonl, and the parts that record
the run's figures (e.g. trackers); the one line a process ends with. Rank 0 holds the RunLog,
every other rank a QuietLog, so the loop reads the same on every rank; one-off lines say
`if is_main():`."""

import contextlib
import functools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engine.distributed import PeerFailed, get_rank, is_main, lost_peer
from engine.errors import StoppedAtOnce, UsageError
from engine.files import append_json_line, rewind_json_lines
from engine.hooks import modules
from engine.lifecycle import STOP_SIGNALS


def log(message: str) -> None:
    """Print a line (above the progress bar, if one is showing)."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


class RunLog(contextlib.AbstractContextManager):
    """Rank 0's record of the run (a resumed run appends to metrics.jsonl). Leaving it closes the
    parts' records, marked failed if an error is on its way. `samples_per_step` is the effective batch."""

    def __init__(self, cfg, samples_per_step: int, start_step: int, parts=()):
        self.every, self.samples_per_step = cfg.train.log_every_steps, samples_per_step
        self.metrics_path = Path(cfg.output_dir) / "metrics.jsonl"
        # Rows of steps after the checkpoint the run starts from (work it does again, e.g.
        # after a save that failed) and torn lines go aside: no epoch has two rows, nothing is lost.
        aside = self.metrics_path.with_name("metrics.rewound.jsonl")
        if moved := rewind_json_lines(self.metrics_path, lambda row: row.get("step", 0) <= start_step, aside):
            note = f"note: {moved} line(s) of {self.metrics_path} after step {start_step} moved to {aside}"
            log(f"{note}; this run writes them again")
        self.parts = parts
        for part in parts:
            part.open_log(start_step)

    def progress(self, epoch: int, total_steps: int, done_steps: int) -> "RunLog":
        """Start an epoch's progress (the loss is read only every train.log_every_steps steps)."""
        self.epoch, self.last_time, self.steps_since_report = epoch, time.perf_counter(), 0
        # disable=None: no bar unless stderr is a terminal; update then prints plain lines.
        self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch}", dynamic_ncols=True, disable=None)
        return self

    def update(self, step: int, loss, lr: float) -> None:
        """Called after every optimizer step."""
        self.bar.update(1)
        self.steps_since_report += 1
        if step % self.every:
            return
        loss = loss.item()  # waits for the device, so the clock below times finished steps
        now = time.perf_counter()
        samples_per_s = self.steps_since_report * self.samples_per_step / max(now - self.last_time, 1e-9)
        self.last_time, self.steps_since_report = now, 0
        if self.bar.disable:
            log(f"epoch {self.epoch} step {step} loss {loss:.4f} lr {lr:.4g} samples/s {samples_per_s:.0f}")
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{samples_per_s:.0f}")  # no-op if disabled
        for part in self.parts:
            part.log_scalars(step, {"train/loss": loss, "train/lr": lr, "train/samples_per_s": samples_per_s})

    def close(self) -> None:
        self.bar.close()

    log = staticmethod(log)  # the module-level log(message)

    def write_epoch(self, metrics: dict) -> None:
        append_json_line(self.metrics_path, metrics)
        log(format_epoch(metrics))
        for part in self.parts:
            part.log_epoch(metrics)

    def __exit__(self, error_type, error, traceback) -> None:
        for part in self.parts:
            part.close_log(failed=error_type is not None)


class QuietLog(contextlib.AbstractContextManager):
    """What ranks other than 0 hold: a RunLog whose calls do nothing."""

    def progress(self, *args) -> "QuietLog":
        return self

    def nothing(self, *args) -> None:
        pass

    update = close = log = write_epoch = __exit__ = nothing


def format_epoch(metrics: dict) -> str:
    """One console line: the train loss, every validation metric, the speed."""
    shown = [f"train_loss {metrics['train_loss']:.4f}"]
    shown += [f"{key} {value:.4f}" for key, value in metrics.items() if "val_" in key]
    speed = f"{metrics['samples_per_s']:.0f} samples/s"
    return f"epoch {metrics['epoch']}: {'  '.join(shown)} ({metrics['num_samples']} samples)  {speed}"


ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each process it starts


def hand_to_launcher(line: str, exit_code: int) -> None:
    """This process's last word and exit code, in the error file torchrun gave it (if any)
    for its failure summary (and a launcher reading it): torchrun stops the others as soon
    as one exits, which may end this one before its exit. Best effort."""
    if path := os.environ.get(ERROR_FILE_VARIABLE):
        with contextlib.suppress(OSError):
            write_last_word(path, line, exit_code)


def write_last_word(path: str, line: str, exit_code: int) -> None:
    # @record's layout: torchrun's summary shows `py_callstack`, here the line itself.
    extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
    Path(path).write_text(json.dumps({"message": {"message": line, "errorCode": exit_code, "extraInfo": extra}}))


def report_errors(main):
    """Turn expected failures into one line on rank 0 instead of a traceback per rank:
    bad input (UsageError: config, data, checkpoint) exits 2; a lost peer process exits 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (UsageError, MemoryError, KeyboardInterrupt, RuntimeError) as error:
            if (ending := last_word(error)) is None:
                raise
            line, exit_code = ending
            if line is not None:  # on stderr, and where torchrun's launcher finds it
                print(line, file=sys.stderr, flush=True)
                hand_to_launcher(line, exit_code)
            else:  # another rank says it: exiting first would have the launcher stop it before its line is out
                for stop_signal in STOP_SIGNALS:  # the launcher's stop, once that rank exits, ends this one at once
                    signal.signal(stop_signal, signal.SIG_DFL)
                time.sleep(3)
            raise SystemExit(exit_code) from None

    return wrapper


def last_word(error: BaseException) -> tuple[str | None, int] | None:
    """(The line this process ends with, None to stay quiet; its exit code), or None."""
    rank = "" if is_main() else f"rank {get_rank()}: "
    if isinstance(error, UsageError):
        # Errors every rank raises alike are shown by rank 0; an error raised on one
        # rank only is shown by that rank; PeerFailed ranks stay quiet.
        shown = not isinstance(error, PeerFailed) and (is_main() or getattr(error, "local", False))
        return f"error: {rank}{last_line(error)}" if shown else None, 2
    for module in modules():  # a part module's own words for an error (e.g. out of host memory)
        if (said := getattr(module, "error_line", lambda _: None)(error)) is not None:
            return f"error: {rank}{said}", 1
    if isinstance(error, KeyboardInterrupt):  # every rank got the signal: rank 0 says it
        if isinstance(error, StoppedAtOnce):  # in training the first Ctrl-C asks for a stop with a checkpoint
            line = (
                "error: stopped at once by a second Ctrl-C; run the same command to continue from the last checkpoint"
            )
        else:  # a stop signal where no checkpoint is kept
            line = "error: stopped by a signal before the end; nothing was written, run the same command again"
        return line if is_main() else None, 130  # as a shell reports a process ended by SIGINT
    if not lost_peer(error):
        return None
    # Every survivor says it: rank 0 may be the process that died. Parts' notes (e.g. where the
    # flight recorder wrote its last collectives) were added as the process group was left.
    notes = "".join(f" {note}" for note in getattr(error, "__notes__", ()))
    return (
        f"rank {get_rank()} stopped: lost contact with another process: it crashed, was killed, or hung longer "
        "than dist.step_timeout_minutes (dist.timeout_minutes before the first step); "
        f"see its output.{notes} {last_line(error)}"
    ), 1


def last_line(error: BaseException) -> str:
    """The message itself; errors re-raised from DataLoader workers carry the worker's
    traceback in front of it."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(rf"^[\w.]*{type(error).__name__}: ", "", lines[-1])
