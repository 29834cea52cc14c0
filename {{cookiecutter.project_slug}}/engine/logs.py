"""What the run tells people: console lines, progress, metrics.jsonl and the trackers.

Rank 0 reports: it holds the RunLog, and every other rank a QuietLog with the same
methods doing nothing, so the loop reads the same on every rank. One-off lines elsewhere
say `if is_main():` at the call site.
"""

import functools
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from engine.distributed import PeerFailed, flight_recorder_file, get_rank, is_main, lost_peer
from engine.errors import UsageError
from engine.files import append_json_line, rewind_json_lines
from engine.launch import hand_to_launcher
from engine.trackers import open_trackers, tracker_runs


def log(message: str) -> None:
    """Print a line (above the progress bar, if one is showing)."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """Rank 0's progress for one epoch: a tqdm bar on a terminal, plain lines otherwise,
    and the step curves in TensorBoard. The loss is read (a host-device sync) only every
    `train.log_every_steps` steps."""

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
        self.run_log.add_scalars(step, {"train/loss": loss, "train/lr": lr, "train/samples_per_s": samples_per_s})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLog:
    """Rank 0's record of the run: one JSON line per epoch in metrics.jsonl (a resumed run
    appends), the same figures in every tracker that is on (engine/trackers.py:
    TensorBoard, W&B, MLflow), and a console line. Use it as a context manager: leaving
    it closes the trackers, marking their run failed if an error is on its way.

    `samples_per_step` is the effective batch (batch_size x processes x accum_steps).
    """

    def __init__(self, cfg, samples_per_step: int, start_step: int, previous_runs: dict):
        self.every, self.samples_per_step = cfg.train.log_every_steps, samples_per_step
        self.metrics_path = Path(cfg.output_dir) / "metrics.jsonl"
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        rewind_metrics(self.metrics_path, start_step)
        self.trackers = open_trackers(cfg, start_step, previous_runs)
        self.tracker_runs = tracker_runs(cfg, self.trackers)  # for the checkpoint
        runs = [f"{name} run {run_id}" for name, run_id in self.tracker_runs.items() if name != "output_dir"]
        if runs:
            log(f"tracking: {', '.join(runs)}")

    def progress(self, epoch: int, total_steps: int, done_steps: int) -> Progress:
        return Progress(self, epoch, total_steps, done_steps)

    def log(self, message: str) -> None:
        log(message)

    def add_scalars(self, step: int, scalars: dict) -> None:
        self.each_tracker(lambda tracker: tracker.add_scalars(step, scalars))

    def write_epoch(self, metrics: dict) -> None:
        append_json_line(self.metrics_path, metrics)

        def send(tracker) -> None:
            tracker.add_scalars(metrics["step"], epoch_scalars(metrics))
            tracker.add_table("memory", metrics["step"], metrics["memory"])
            tracker.flush()

        self.each_tracker(send)
        log(format_epoch(metrics))

    def each_tracker(self, call) -> None:
        """`call(tracker)` for each tracker. One that fails (its server gone, its disk full)
        is dropped with a warning: metrics.jsonl has everything, and an error on rank 0
        alone would leave the other ranks waiting."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:
                self.trackers.remove(tracker)
                log(f"warning: {tracker.name} failed ({last_line(error)}); the run goes on without it")

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        # What is still buffered reaches the disk or the server; an error marks the runs failed.
        self.each_tracker(lambda tracker: tracker.close(failed=error_type is not None))


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
    """One console line: the train loss, every validation metric, throughput."""
    shown = [f"train_loss {metrics['train_loss']:.4f}"]
    shown += [f"{key} {value:.4f}" for key, value in metrics.items() if "val_" in key]
    return (
        f"epoch {metrics['epoch']}: {'  '.join(shown)} ({metrics['num_samples']} samples)  "
        f"{metrics['samples_per_s']:.0f} samples/s"
    )


def epoch_scalars(metrics: dict) -> dict:
    """Tracker tags for one epoch's metrics (as in metrics.jsonl): train_x as
    train/epoch_x, val_x as val/x, a part's ema_val_x (the EMA's) as val_ema/x. Memory: rank 0's
    figure and the largest over the ranks (`..._max`)."""
    scalars = {"throughput/samples_per_s": metrics["samples_per_s"]}
    for key, value in metrics.items():
        if key.startswith("train_") and key != "train_time_s":
            scalars[f"train/epoch_{key.removeprefix('train_')}"] = value
        elif key.startswith("val_"):
            scalars[f"val/{key.removeprefix('val_')}"] = value
        elif "_val_" in key:
            part, name = key.split("_val_", 1)
            scalars[f"val_{part}/{name}"] = value
    per_rank = metrics["memory"]
    for key in ("rss_peak_mib", "cuda_reserved_peak_mib"):
        if key in per_rank[0]:
            scalars[f"memory/{key}"] = per_rank[0][key]
            scalars[f"memory/{key}_max"] = max(row[key] for row in per_rank)
    return scalars


def say_last(line: str, exit_code: int) -> None:
    """A process's last word: on stderr, and in the error file torchrun gives it, where
    torchrun's failure summary and `python -m engine.launch` find it."""
    print(line, file=sys.stderr, flush=True)
    hand_to_launcher(line, exit_code)


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
            trace = flight_recorder_file()  # written as the process group was left
            history = f" Its last collectives: {trace}." if trace and trace.exists() else ""
            say_last(
                f"rank {get_rank()} stopped: lost contact with another process: it crashed, was killed, "
                "or hung longer than dist.step_timeout_minutes (dist.timeout_minutes before the first step); "
                f"see its output.{history} {last_line(error)}",
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
