"""A run's life: one run per output_dir (RunLock: a double submit or a requeue race refused, a dead holder's lock
taken over), and a clean stop when asked (StopRequest: signals only noted, the ranks stop together at agreed
steps after a checkpoint, within the 30 s torchrun gives before SIGKILL)."""

import contextlib
import datetime
import functools
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from engine.distributed import get_world_size, is_main, vote
from engine.errors import OutputDirInUse, StoppedAtOnce
from engine.files import create_whole, not_written

HEARTBEAT_S = 30.0
STALE_S = 120.0  # four missed heartbeats
WATCH_S = 1.0  # how often a possible restart looks at its predecessor's heartbeat
LOCK_NAME = "run.lock"
# A scheduler's, Ctrl-C, SLURM's warning, a closed terminal or ssh session, Ctrl-\: each a stop with a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
CHECK_EVERY_SECONDS = 0.5  # how often ranks compare notes: a few hundred us each time
LAUNCHER_GONE = "the loss of its launcher"
PARENT_CHECK_S = 1.0  # how often a rank looks for its launcher: one getppid() call
ORPHAN_GRACE_S = 30.0  # as long as torchrun gives its workers between SIGTERM and SIGKILL
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped before the end (a checkpoint if it could); run the same command again


def count(value) -> int:
    """A restart count, a string (environment) or a number (lock); 0 if none."""
    text = str(value)
    return int(text) if text.isascii() and text.isdigit() else 0


class RunLock:
    """Rank 0's hold on output_dir for the whole run; `release()` on the way out."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        run_id, job = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("SLURM_JOB_ID")
        store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        torchrun = f"{run_id}@{store}" if run_id not in (None, "", "none") else ""  # "none": an id torchrun made up
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "launch": f"slurm:{job}" if job else f"torchrun:{torchrun}" if torchrun else "",
            "requeues": count(os.environ.get("SLURM_RESTART_COUNT")),  # unset until the first requeue
            "torchrun": torchrun,
            "restarts": count(os.environ.get("TORCHELASTIC_RESTART_COUNT")),
        }
        self.stop = threading.Event()

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        first_look = None  # (holder, modification time) of a holder being watched
        while not self.try_create():
            holder, modified = self.read_holder(), self.modified()
            if holder is not None and not self.is_stale(holder, modified):
                if self.may_be_my_restart(holder) and first_look in (None, (holder, modified)):
                    first_look = first_look or (holder, modified)
                    time.sleep(WATCH_S)  # until it is stale, or a heartbeat shows it alive
                    continue
                raise self.in_use(holder)
            if self.read_holder() == holder:  # stale, and not replaced meanwhile: take it over
                self.path.unlink(missing_ok=True)
        threading.Thread(target=self.heartbeat, name="run-lock-heartbeat", daemon=True).start()
        return self

    def try_create(self) -> bool:
        """Whole or not at all: a full disk never leaves an empty lock to block the next start."""
        try:
            create_whole(self.path, lambda f: f.write(json.dumps(self.me).encode()))
        except FileExistsError:
            return False
        except OSError as error:
            raise not_written(self.path, error) from None
        return True

    def in_use(self, holder: dict) -> OutputDirInUse:
        folder = str(self.path.parent)
        if not holder:
            return OutputDirInUse(
                f"output_dir {folder!r} may be in use: its {LOCK_NAME} is empty or unreadable, as a run of an older "
                f"version of this project may leave it (it is taken over {STALE_S / 60:g} minutes after its last "
                f"change); if no run uses that folder, delete {self.path}"
            )
        return OutputDirInUse(
            f"output_dir {folder!r} is in use by the run on host {holder['host']}, pid {holder['pid']}, started "
            f"{holder.get('started')}; wait for it or choose another output_dir (if that run is gone, delete "
            f"{self.path})"
        )

    def read_holder(self) -> dict | None:
        """The holder as written; {} if it names none (an older version's lock); None if gone meanwhile."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) and {"host", "pid"} <= holder.keys() else {}

    def modified(self) -> float | None:
        with contextlib.suppress(FileNotFoundError):
            return self.path.stat().st_mtime

    def is_stale(self, holder: dict, modified: float | None) -> bool:
        """Dead or silent; on another host also an earlier start of this launch. On this host a live
        pid holds it whatever its restart counts say (they are only environment variables)."""
        silent = modified is None or time.time() - modified > STALE_S
        if holder.get("host") != self.me["host"]:
            return self.earlier_start(holder) or silent
        pid = holder.get("pid")  # this process's: a dead holder's pid came back (in a container, every start)
        return pid == self.me["pid"] or not pid_alive(pid) or silent

    def earlier_start(self, holder: dict) -> bool:
        """An earlier start of this launch (not a run of the same start, e.g. two terminals in one salloc)."""
        if not holder.get("launch") or holder["launch"] != self.me["launch"]:
            return False
        same_torchrun = bool(self.me["torchrun"]) and holder.get("torchrun") == self.me["torchrun"]
        start = (count(holder.get("requeues")), count(holder.get("restarts")) if same_torchrun else 0)
        return start < (self.me["requeues"], self.me["restarts"] if same_torchrun else 0)

    def may_be_my_restart(self, holder: dict) -> bool:
        """The same torchrun run id from another store and host: a restart whose rank 0 moved, or a second launch."""
        run_id = self.me["launch"].partition("@")[0]
        same_id = str(holder.get("launch", "")).partition("@")[0] == run_id
        return run_id.startswith("torchrun:") and same_id and holder.get("host") != self.me["host"]

    def heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # the next beat retries; a lock gone for good shows as stale
                os.utime(self.path)

    def release(self) -> None:
        """Delete the lock if it is still ours (a stale take-over may have replaced it)."""
        self.stop.set()
        if self.read_holder() == self.me:
            self.path.unlink(missing_ok=True)


def pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return not zombie(pid)


def zombie(pid: int) -> bool:
    """Dead but not yet reaped (a killed rank whose launcher died too): signals reach it, but it holds nothing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False  # no /proc (not Linux): trust the signal


class StopRequest:
    """When to stop before the last epoch ends, the same on every rank: on a stop signal, or at train.stop_at_step."""

    def __init__(self, timeout_minutes: float, stop_at_step: int = 0):
        self.stop_at_step = stop_at_step  # 0: none
        self.signal_name = ""
        # Notes travel over a CPU (gloo) group of their own: comparing them never waits for the GPU.
        timeout = datetime.timedelta(minutes=timeout_minutes)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if get_world_size() > 1 else None
        self.between_steps = NoteComparison(self.group)
        self.parent = None  # the launcher's pid, when there is one to watch
        self.by_signal = False  # whether the ranks agreed on a stop by a signal (or the launcher's loss)

    def install(self, launcher: str) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        if launcher != "none":
            self.parent = os.getppid()
            threading.Thread(target=self.watch_launcher, name="launcher-watch", daemon=True).start()
        return self

    def launcher_gone(self) -> bool:
        return self.parent is not None and os.getppid() != self.parent

    def watch_launcher(self) -> None:
        while not self.launcher_gone():
            time.sleep(PARENT_CHECK_S)
        self.signal_name = self.signal_name or LAUNCHER_GONE
        time.sleep(ORPHAN_GRACE_S)
        os._exit(STOPPED_EXIT_CODE)  # the stop did not finish: leave without its checkpoint

    def handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name:
            raise StoppedAtOnce  # a second Ctrl-C: stop now, without a checkpoint
        self.signal_name = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """Whether to stop after optimizer step `step`; every rank calls this after every step."""
        return self.noted_anywhere(self.between_steps, step) or step == self.stop_at_step

    def reason(self, step: int) -> str:
        if step == self.stop_at_step and not self.signal_name:
            return "at train.stop_at_step"
        return f"by {self.signal_name or (LAUNCHER_GONE if self.launcher_gone() else 'a signal to another process')}"

    def noted_anywhere(self, comparison: "NoteComparison", count: int) -> bool:
        self.by_signal = self.by_signal or comparison.any_noted(bool(self.signal_name), count)
        return self.by_signal

    def during_evaluation(self) -> Callable[[int], bool]:
        """For one evaluation: asked by every rank after each round of batches."""
        return functools.partial(self.noted_anywhere, NoteComparison(self.group))

    def exit_code(self) -> int:
        return STOPPED_EXIT_CODE if self.by_signal else 0


class NoteComparison:
    """Stop notes compared at agreed counts; rank 0 proposes the next in the same all-reduce: no clock must agree."""

    def __init__(self, group):
        self.group = group  # None: one process, nothing to compare
        self.next_check = 0
        self.last_check = None  # (count, time) of the previous comparison

    def any_noted(self, noted: bool, count: int) -> bool:
        if self.group is None:
            return noted
        if count < self.next_check:
            return False
        now = time.monotonic()
        ahead = 1  # the first count: no rate known yet
        if self.last_check is not None:
            last_count, last_time = self.last_check
            per_second = (count - last_count) / max(now - last_time, 1e-6)
            # At most twice the last interval: a burst (prefetched batches) could propose a count never reached.
            ahead = min(max(1, int(per_second * CHECK_EVERY_SECONDS)), 2 * (count - last_count))
        any_noted, next_check = vote([float(noted), float(count + ahead if is_main() else 0)], "max", self.group)
        self.next_check = int(next_check)
        self.last_check = (count, now)
        return bool(any_noted)


def leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """In a DataLoader worker: ignore stop signals but the rank's own SIGTERM (dying would cut its checkpoint)."""
    for sig in set(STOP_SIGNALS) - {signal.SIGTERM}:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started next inherit it
    threading.Thread(target=exit_on_sigterm_from, args=(os.getppid(),), daemon=True).start()


def exit_on_sigterm_from(rank_pid: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank_pid:
        pass  # from the launcher: the rank stops, then ends this worker
    os._exit(0)
