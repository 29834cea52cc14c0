"""One run per output_dir: a second run started on the same folder (a double submit, a
requeue race) would write checkpoints and metrics beside the first.

Rank 0 creates <output_dir>/run.lock atomically (O_EXCL) before anything else is
written there. It names the holder's host, pid, start time, launch and which start of
the launch it is, and rank 0
refreshes its modification time every HEARTBEAT_S seconds from a background thread.

A lock found on disk is taken over, not obeyed, when its holder is gone:
- an earlier start of the same launch: the same SLURM job before a requeue (a lower
  SLURM_RESTART_COUNT), or the same torchrun launch before an elastic restart (a lower
  TORCHELASTIC_RESTART_COUNT), whose processes are dead or being replaced. Two runs of
  one start (two terminals in one salloc) are told apart by the rules below, like any two;
- the same host, and no process with the holder's pid is alive (a kill -9, a crash);
- any host, and the lock has not been refreshed for STALE_S seconds (a dead node: on a
  shared file system another node cannot look up the holder's pid, but it can see
  that the heartbeat stopped; an empty or unreadable lock, which no run of this
  version leaves, goes the same way).
Otherwise the run refuses at once, naming the holder. A lock left by a dead node on
another host therefore blocks for at most STALE_S seconds.

A torchrun launch is its run id (`--rdzv_id`) and the store its agents serve the workers
(MASTER_ADDR:MASTER_PORT). The id alone is not enough: it is whatever the command line
says, so two launches of one script share it. The store lives exactly as long as one
launch, and a restart keeps it unless rank 0 moved to another node. Such a holder (the
same run id, another store, another host) may be either kind, so it is watched: a
heartbeat means a second launch, refused; silence for STALE_S means a restart, which
takes the lock over.
"""

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

from engine.errors import OutputDirInUse, UsageError
from engine.files import write_temporary

HEARTBEAT_S = 30.0
STALE_S = 120.0  # four missed heartbeats
WATCH_S = 1.0  # how often a possible restart looks at its predecessor's heartbeat
LOCK_NAME = "run.lock"


def this_launch() -> str:
    """What survives a restart of the same job, and only of it: SLURM's job id;
    torchrun's run id with its store's address ("" for a run id torchrun made up)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm:{job}"
    torchrun = torchrun_launch()
    return f"torchrun:{torchrun}" if torchrun else ""


def torchrun_launch() -> str:
    """torchrun's run id with its store's address, "" without one (or an id torchrun made up)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or run_id == "none":
        return ""
    return f"{run_id}@{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def this_start() -> dict:
    """Which start of its launch this run is: SLURM counts the job's requeues; torchrun the
    restarts of its launch (within one start of a SLURM job, for srun torchrun)."""
    return {
        "requeues": count(os.environ.get("SLURM_RESTART_COUNT")),  # unset until the first requeue
        "torchrun": torchrun_launch(),
        "restarts": count(os.environ.get("TORCHELASTIC_RESTART_COUNT")),
    }


def count(value) -> int:
    """A restart count as written (a string in the environment, a number in a lock); 0 if none."""
    text = str(value)
    return int(text) if text.isascii() and text.isdigit() else 0


class RunLock:
    """Rank 0's hold on output_dir for the whole run; `release()` on the way out."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "launch": this_launch(),
            **this_start(),
        }
        self.stop = threading.Event()
        self.thread = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        first_look = None  # (holder, modification time) of a holder being watched
        while not self.try_create():
            holder, modified = self.read_holder(), self.modified()
            if holder is not None and not self.is_stale(holder):
                if self.may_be_my_restart(holder) and first_look in (None, (holder, modified)):
                    first_look = first_look or (holder, modified)
                    time.sleep(WATCH_S)  # until it is stale, or a heartbeat shows it alive
                    continue
                raise self.in_use(holder)
            if self.read_holder() == holder:  # stale, and not replaced meanwhile: take it over
                self.path.unlink(missing_ok=True)
        self.thread = threading.Thread(target=self.heartbeat, name="run-lock-heartbeat", daemon=True)
        self.thread.start()
        return self

    def try_create(self) -> bool:
        """Create the lock, whole or not at all: written beside it, then linked into place,
        which fails if a lock exists. A lock that could not be written (a full disk)
        is never left empty, where it would block the next start as a live holder's."""
        tmp = None
        try:  # a temporary of a random name, created anew: never a link planted there, nor another run's
            tmp = write_temporary(self.path.parent, LOCK_NAME, lambda f: f.write(json.dumps(self.me).encode()))
            os.link(tmp, self.path, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as error:
            raise UsageError(
                f"cannot write {str(self.path)!r}: {error.strerror or error}; free disk space or choose "
                "another output_dir, then run the same command again"
            ) from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
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
        """The holder as written; {} if it names none (empty: an older version's lock, or a
        crashed file system's); None if gone meanwhile."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) and {"host", "pid"} <= holder.keys() else {}

    def modified(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except FileNotFoundError:
            return None

    def is_stale(self, holder: dict) -> bool:
        if self.earlier_start(holder):
            return True
        if holder.get("host") == self.me["host"] and not self.other_live_process(holder.get("pid")):
            return True
        modified = self.modified()
        return modified is None or time.time() - modified > STALE_S

    def earlier_start(self, holder: dict) -> bool:
        """The holder is an earlier start of this run's launch: its SLURM job before a requeue,
        or its torchrun launch before an elastic restart. Not a run of the same start."""
        if not holder.get("launch") or holder["launch"] != self.me["launch"]:
            return False
        if count(holder.get("requeues")) != self.me["requeues"]:
            return count(holder.get("requeues")) < self.me["requeues"]
        same_torchrun = bool(self.me["torchrun"]) and holder.get("torchrun") == self.me["torchrun"]
        return same_torchrun and count(holder.get("restarts")) < self.me["restarts"]

    def other_live_process(self, pid) -> bool:
        """A live process of this host other than this one: a holder with this process's pid
        is a dead one whose pid came back (in a container, the same few pids every start)."""
        return pid != self.me["pid"] and pid_alive(pid)

    def may_be_my_restart(self, holder: dict) -> bool:
        """The same torchrun run id, another store, another host: a restart whose rank 0
        moved to another node, or a second launch with the same --rdzv_id."""
        run_id = self.me["launch"].partition("@")[0]
        return (
            run_id.startswith("torchrun:")
            and str(holder.get("launch", "")).partition("@")[0] == run_id
            and holder.get("host") != self.me["host"]
        )

    def heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the next beat retries; a lock gone for good shows as stale to others

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
    """Dead but not yet reaped (a killed rank whose launcher died too waits for init):
    signals still reach it, but it holds nothing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False  # no /proc (not Linux): trust the signal
