"""What the run tells people: console lines, progress, metrics.jsonl{% if cookiecutter.tracking %}, and the parts that
record the run's figures (e.g. trackers){% endif %}.

Rank 0 reports: it holds the RunLog, and every other rank a QuietLog with the same
methods doing nothing, so the loop reads the same on every rank. One-off lines elsewhere
say `if is_main():` at the call site.
"""

import contextlib
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engine.distributed import PeerFailed, {{ 'flight_recorder_file, ' if cookiecutter.run_record }}get_rank, is_main, lost_peer
from engine.errors import UsageError
from engine.files import append_json_line, rewind_json_lines


def log(message: str) -> None:
    """Print a line (above the progress bar, if one is showing)."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """Rank 0's progress for one epoch: a tqdm bar on a terminal, plain lines otherwise{% if cookiecutter.tracking %},
    and the step curves for the parts that record them{% endif %}. The loss is read (a host-device
    sync) only every `train.log_every_steps` steps."""

    def __init__(self, run_log: "RunLog", epoch: int, total_steps: int, done_steps: int):
        self.run_log, self.epoch = run_log, epoch
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch}", dynamic_ncols=True)
        self.last_time, self.steps_since_report = time.perf_counter(), 0

    def update(self, step: int, loss, lr: float) -> None:
        """Called after every optimizer step."""
        if self.bar is not None:
            self.bar.update(1)
        self.steps_since_report += 1
        if step % self.run_log.every:
            return
        loss = loss.item()  # waits for the device, so the clock below times finished steps
        now = time.perf_counter()
        samples_per_s = self.steps_since_report * self.run_log.samples_per_step / max(now - self.last_time, 1e-9)
        self.last_time, self.steps_since_report = now, 0
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{samples_per_s:.0f}")
        else:
            print(
                f"epoch {self.epoch} step {step} loss {loss:.4f} lr {lr:.4g} samples/s {samples_per_s:.0f}",
                flush=True,
            )
{%- if cookiecutter.tracking %}
        self.run_log.add_scalars(step, {"train/loss": loss, "train/lr": lr, "train/samples_per_s": samples_per_s})
{%- endif %}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLog:
{%- if cookiecutter.tracking %}
    """Rank 0's record of the run: one JSON line per epoch in metrics.jsonl (a resumed run
    appends), the same figures to each part that records them (e.g. TensorBoard, W&B,
    MLflow: engine/parts/tracking.py), and a console line. Use it as a context manager:
    leaving it closes the parts' records, marked failed if an error is on its way.
{%- else %}
    """Rank 0's record of the run: one JSON line per epoch in metrics.jsonl (a resumed run
    appends), and a console line.
{%- endif %}

    `samples_per_step` is the effective batch (batch_size x processes x accum_steps).
    """

    def __init__(self, cfg, samples_per_step: int, start_step: int{{ ', parts: list' if cookiecutter.tracking }}):
        self.every, self.samples_per_step = cfg.train.log_every_steps, samples_per_step
        self.metrics_path = Path(cfg.output_dir) / "metrics.jsonl"
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        rewind_metrics(self.metrics_path, start_step)
{%- if cookiecutter.tracking %}
        self.parts = parts
        for part in parts:
            part.open_log(start_step)
{%- endif %}

    def progress(self, epoch: int, total_steps: int, done_steps: int) -> Progress:
        return Progress(self, epoch, total_steps, done_steps)

    def log(self, message: str) -> None:
        log(message)

{%- if cookiecutter.tracking %}

    def add_scalars(self, step: int, scalars: dict) -> None:
        for part in self.parts:
            part.log_scalars(step, scalars)
{%- endif %}

    def write_epoch(self, metrics: dict) -> None:
        append_json_line(self.metrics_path, metrics)
{%- if cookiecutter.tracking %}
        for part in self.parts:
            part.log_epoch(metrics)
{%- endif %}
        log(format_epoch(metrics))

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
{%- if cookiecutter.tracking %}
        for part in self.parts:
            part.close_log(failed=error_type is not None)
{%- else %}
        pass
{%- endif %}


def rewind_metrics(path: Path, start_step: int) -> None:
    """metrics.jsonl as of the checkpoint the run starts from: rows of later steps (work
    this run does again, e.g. after a save that failed) and torn lines go to
    metrics.rewound.jsonl, so no epoch has two rows and nothing is deleted."""
    aside = path.with_name("metrics.rewound.jsonl")
    moved = rewind_json_lines(path, lambda row: row.get("step", 0) <= start_step, aside)
    if moved:
        log(f"note: {moved} line(s) of {path} after step {start_step} moved to {aside}; this run writes them again")


class QuietLog:
    """A RunLog's calls, doing nothing: what ranks other than 0 hold."""

    def progress(self, epoch: int, total_steps: int, done_steps: int) -> "QuietLog":
        return self  # a progress bar's calls too

    def update(self, step: int, loss, lr: float) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def write_epoch(self, metrics: dict) -> None:
        pass

    def close(self) -> None:  # a progress bar's
        pass

    def __enter__(self) -> "QuietLog":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        pass


def format_epoch(metrics: dict) -> str:
    """One console line: the train loss, every validation metric, the speed."""
    shown = [f"train_loss {metrics['train_loss']:.4f}"]
    shown += [f"{key} {value:.4f}" for key, value in metrics.items() if "val_" in key]
    speed = [f"{metrics['samples_per_s']:.0f} samples/s"]
{%- if cookiecutter.throughput %}
    speed += [f"{metrics[key]:,.0f} {key.removesuffix('_per_s')}/s" for key in items_keys(metrics)]
    speed += [f"MFU {metrics['mfu']:.1%}"] if "mfu" in metrics else []
{%- endif %}
    return f"epoch {metrics['epoch']}: {'  '.join(shown)} ({metrics['num_samples']} samples)  {', '.join(speed)}"


{%- if cookiecutter.throughput %}


def items_keys(metrics: dict) -> list[str]:
    """The task's <unit>_per_s (engine/throughput.py)."""
    return [key for key in metrics if key.endswith("_per_s") and key not in ("samples_per_s", "model_tflops_per_s")]
{%- endif %}


def say_last(line: str, exit_code: int) -> None:
    """A process's last word: on stderr, and in the error file torchrun gives it, where
    torchrun's failure summary and `python -m engine.launch` find it."""
    print(line, file=sys.stderr, flush=True)
    hand_to_launcher(line, exit_code)


ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each process it starts


def hand_to_launcher(line: str, exit_code: int) -> None:
    """Leave this process's last word (one line) and the exit code it is about to exit
    with in the error file torchrun gave it, if any. The code matters: torchrun sends
    SIGTERM to the other processes as soon as one exits, which may end this one before
    its exit. Best effort: the line is on stderr already."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    if path:
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
        except UsageError as error:
            # Errors every rank raises alike are shown by rank 0; an error raised on one
            # rank only is shown by that rank; PeerFailed ranks stay quiet.
            if not isinstance(error, PeerFailed) and (is_main() or getattr(error, "local", False)):
                prefix = "" if is_main() else f"rank {get_rank()}: "
                say_last(f"error: {prefix}{last_line(error)}", 2)
            raise SystemExit(2) from None
        except MemoryError:  # host memory: the data, the batch or the model is larger than this machine holds
            out_of_host_memory()
        except KeyboardInterrupt:  # a second Ctrl-C (the first asks for a stop with a checkpoint)
            if is_main():
                say_last(
                    "error: stopped at once by a second Ctrl-C; run the same command to continue from the "
                    "last checkpoint",
                    130,
                )
            raise SystemExit(130) from None  # as a shell reports a process ended by SIGINT
        except RuntimeError as error:
            if HOST_ALLOCATION_FAILED in str(error):  # torch's own MemoryError
                out_of_host_memory()
            if not lost_peer(error):
                raise
            # Every survivor says it: rank 0 may be the process that died.
{%- if cookiecutter.run_record %}
            trace = flight_recorder_file()  # written as the process group was left
            history = f" Its last collectives: {trace}." if trace and trace.exists() else ""
{%- endif %}
            say_last(
                f"rank {get_rank()} stopped: lost contact with another process: it crashed, was killed, "
                "or hung longer than dist.step_timeout_minutes (dist.timeout_minutes before the first step); "
                f"see its output.{{ '{history}' if cookiecutter.run_record }} {last_line(error)}",
                1,
            )
            raise SystemExit(1) from None

    return wrapper


HOST_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


def out_of_host_memory() -> None:
    say_last(
        f"error: {'' if is_main() else f'rank {get_rank()}: '}out of host memory; use smaller data, "
        "batches (train.batch_size) or model, fewer DataLoader workers, or a machine with more memory",
        1,
    )
    raise SystemExit(1) from None


def last_line(error: Exception) -> str:
    """The message itself; errors re-raised from DataLoader workers carry the worker's
    traceback in front of it."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(rf"^[\w.]*{type(error).__name__}: ", "", lines[-1])
