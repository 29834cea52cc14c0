"""One run per output_dir: a second run started on the same folder (a double submit, a
requeue race) would write checkpoints and metrics beside the first.

Rank 0 creates <output_dir>/run.lock atomically (O_EXCL) before anything else is
written there. It names the holder's host, pid, start time and launch, and rank 0
refreshes its modification time every HEARTBEAT_S seconds from a background thread.

A lock found on disk is taken over, not obeyed, when its holder is gone:
- the same launch: the same SLURM job (a requeue) or the same torchrun run id (an
  elastic restart), whose earlier processes are dead or being replaced;
- the same host, and no process with the holder's pid is alive (a kill -9, a crash);
- any host, and the lock has not been refreshed for STALE_S seconds (a dead node: on a
  shared file system another node cannot look up the holder's pid, but it can see
  that the heartbeat stopped).
Otherwise the run refuses at once, naming the holder. A lock left by a dead node on
another host therefore blocks for at most STALE_S seconds.
"""

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

from engine.errors import OutputDirInUse

HEARTBEAT_S = 30.0
STALE_S = 120.0  # four missed heartbeats
LOCK_NAME = "run.lock"


def this_launch() -> str:
    """What survives a restart of the same job: SLURM's job id, torchrun's run id."""
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm:{job}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun:{run_id}" if run_id and run_id != "none" else ""


class RunLock:
    """Rank 0's hold on output_dir for the whole run; `release()` on the way out."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "launch": this_launch(),
        }
        self.stop = threading.Event()
        self.thread = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self.try_create():
            holder = self.read_holder()
            if holder is not None and not self.is_stale(holder):
                raise OutputDirInUse(
                    f"output_dir {str(self.path.parent)!r} is in use by the run on host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, started {holder.get('started')}; wait for it or choose another "
                    f"output_dir (if that run is gone, delete {self.path})"
                )
            if self.read_holder() == holder:  # stale, and not replaced meanwhile: take it over
                self.path.unlink(missing_ok=True)
        self.thread = threading.Thread(target=self.heartbeat, name="run-lock-heartbeat", daemon=True)
        self.thread.start()
        return self

    def try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        return True

    def read_holder(self) -> dict | None:
        """The holder as written, {} if unreadable (a torn write), None if gone meanwhile."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def is_stale(self, holder: dict) -> bool:
        if holder.get("launch") and holder.get("launch") == self.me["launch"]:
            return True
        if holder.get("host") == self.me["host"] and not pid_alive(holder.get("pid")):
            return True
        try:
            return time.time() - self.path.stat().st_mtime > STALE_S
        except FileNotFoundError:
            return True

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
    return True
