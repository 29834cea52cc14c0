"""sweep.py's runs, one at a time, under a supervisor: the stop signals it gets reach the run in
progress, and a run never outlives it."""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from engine.lifecycle import STOP_SIGNALS, STOPPED_EXIT_CODE

PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent dies (Linux)


class Supervisor:
    def __init__(self):
        self.child = None
        self.received = []  # stop signals, in order

    def __enter__(self) -> "Supervisor":
        self.previous = {sig: signal.signal(sig, self.receive) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *error) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @property
    def stop_signal(self) -> str:
        return self.received[0].name if self.received else ""

    def run(self, command: list[str], env: dict | None = None) -> str:
        """How it ended: "ok", "stopped" (STOPPED_EXIT_CODE, or failed after a signal passed on) or "exit N"."""
        self.passed = 0  # how many of the stop signals this child got
        set_up = terminated_with_parent(os.getpid())
        self.child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=set_up)
        self.pass_on()  # a signal that came while it started
        code = self.child.wait()
        self.child = None
        if code == 0:
            return "ok"
        return "stopped" if code == STOPPED_EXIT_CODE or self.passed else f"exit {code}"

    def receive(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum))
        self.pass_on()

    def pass_on(self) -> None:
        """To the child's process group, as a terminal would: the first stop signal, then a SIGINT (stop now)."""
        due = self.received[:1] + ([signal.SIGINT] if signal.SIGINT in self.received[1:] else [])
        for sent in due[self.passed :] if self.child is not None else ():
            self.passed += 1
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.killpg(self.child.pid, sent)


def terminated_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when `parent` dies, at once if it died before this was set."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def set_up() -> None:
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return set_up
