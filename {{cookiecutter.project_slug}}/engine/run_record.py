"""What a run leaves about itself: what produced it, and rank 0's lines in train.log.

What produced it: the code's git commit, the versions, the launch and its hosts.
Recorded in every checkpoint ("provenance") and in the header of output_dir/config.yaml;
the run's opening line says the commit. A project outside a git repository records no
commit, and says so; so does a run where git is missing, fails or does not answer, or
where the config's `provenance` is false (then no git runs at all).

git runs in the project folder (rev-parse HEAD, then status --porcelain), under the
repository's own settings: its fsmonitor command (core.fsmonitor), optional locks and
prompts are turned off; what else the repository names (a filter) may run, and is
stopped with git after GIT_TIMEOUT seconds.

train.log: everything rank 0 prints, the error that ends a run included, appended across
resumes (`keep_output_in`). The flight recorder, each rank's last collectives written to
output_dir/flight_recorder/ on a hang, is set up by engine/distributed.py when this part is
generated.
"""

import contextlib
import importlib.metadata
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.distributed import DistEnv, all_gather_objects, broadcast_from_main, is_main


def describe_run(env: DistEnv, code: Path, record_git: bool = True) -> dict:
    """The run's provenance, the same on every rank: `code` is the project's folder;
    `record_git`: whether git is asked for its commit (the config's `provenance`). Every
    rank must call this (it gathers the host names)."""
    hosts = all_gather_objects(socket.gethostname())
    state = (git_state(code) if record_git else NOT_ASKED) if is_main() else None
    return {
        "git": broadcast_from_main(state),  # one git call per job
        "versions": versions(),
        "launch": {"launcher": env.launcher, "world_size": env.world_size, "nodes": len(set(hosts))},
        "hosts": list(dict.fromkeys(hosts)),  # in rank order, each once
    }


GIT_TIMEOUT = 10  # seconds for both git calls: a repository's own hooks or filters may hang
NOT_ASKED = {"unknown": "git commit not recorded (provenance=false)"}


class GitFailed(Exception):
    """git did not say: the message is why, for the run's opening line."""


class GitHung(GitFailed):
    """git did not answer in time; it was stopped, with all it started."""


def git_state(folder: Path, timeout: float = GIT_TIMEOUT) -> dict | None:
    """{"commit": sha, "dirty": whether tracked or new files differ from it}; None outside
    a git repository; {"unknown": why} where git is missing, fails or does not answer."""
    deadline = time.monotonic() + timeout
    try:
        head = git(folder, deadline, "rev-parse", "HEAD")
        if head is None:
            return None
        changes = git(folder, deadline, "status", "--porcelain")
    except GitHung:
        return {"unknown": f"git state unknown: git did not answer within {timeout:g} s"}
    except GitFailed as error:
        return {"unknown": f"git state unknown: {error}"}
    return {"commit": head, "dirty": bool(changes)}


# With core.fsmonitor=false (below) git runs no fsmonitor command of the repository; it
# takes no optional lock (a run must not block the user's git), asks nothing, speaks English.
GIT_ENV = {"GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}


def git(folder: Path, deadline: float, *args: str) -> str | None:
    """git's output; None outside a repository. Its own session, so that a timeout stops
    whatever it started too (a hook, a filter), not git alone."""
    command = ["git", "-c", "core.fsmonitor=false", *args]
    env = {**os.environ, **GIT_ENV}
    pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    try:
        process = subprocess.Popen(command, cwd=folder, env=env, text=True, start_new_session=True, **pipes)
    except FileNotFoundError:
        raise GitFailed("git is not installed") from None
    except OSError as error:
        raise GitFailed(f"git cannot start: {error.strerror}") from None
    with process:  # closes the pipes without reading on: what git started may hold them
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as error:  # the time limit, or a Ctrl-C meanwhile: nothing of git is left
            with contextlib.suppress(ProcessLookupError):  # the whole session's group: git's children too
                os.killpg(process.pid, signal.SIGKILL)
            if isinstance(error, subprocess.TimeoutExpired):
                raise GitHung() from None
            raise
    if process.returncode == 0:
        return out.strip()
    if "not a git repository" in err:
        return None
    first = err.strip().splitlines()[0] if err.strip() else f"exit code {process.returncode}"
    raise GitFailed(f"git {args[0]} failed: {first}")


def versions() -> dict:
    cuda = torch.cuda.is_available()
    try:
        torchvision = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        torchvision = None
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass, which a weights-only load refuses
        "torchvision": torchvision,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def commit_line(provenance: dict) -> str:
    """E.g. 'commit 1a2b3c4d5e6f (uncommitted changes)', for the run's opening line."""
    state = provenance["git"]
    if state is None:
        return "no git commit (not a git repository)"
    if "unknown" in state:
        return state["unknown"]
    return f"commit {state['commit'][:12]}{' (uncommitted changes)' if state['dirty'] else ''}"


def header(provenance: dict) -> str:
    """Comment lines for the top of the saved config: what produced the run."""
    launch, found = provenance["launch"], provenance["versions"]
    shown = ", ".join(f"{name} {version}" for name, version in found.items() if version)
    return (
        f"# produced by {commit_line(provenance)}\n# {shown}\n"
        f"# {launch['world_size']} process(es) on {launch['nodes']} node(s) ({launch['launcher']}): "
        f"{shown_hosts(provenance['hosts'])}\n"
    )


def shown_hosts(hosts: list[str], most: int = 8) -> str:
    more = f" and {len(hosts) - most} more" if len(hosts) > most else ""
    return ", ".join(hosts[:most]) + more


def keep_output_in(path: Path) -> None:
    """From here to the process's end, what it prints (stdout and stderr: its lines, the
    errors that end it) is also appended to `path`: rank 0's record of the run, which a
    resumed run continues. A progress bar's redrawn line is left out."""
    record = Record(path)
    sys.stdout, sys.stderr = AlsoTo(sys.stdout, record), AlsoTo(sys.stderr, record)


class Record:
    """A file of whole lines, appended. A write that fails (a full disk) ends the record,
    said once on the terminal: the run itself goes on."""

    def __init__(self, path: Path):
        self.path, self.file = path, path.open("a", encoding="utf-8", buffering=1)  # a line at a time

    def write(self, text: str, terminal) -> None:
        if self.file is None:
            return
        try:
            self.file.write(text)
        except OSError as error:
            self.file = None
            terminal.write(f"warning: {self.path} records no more of this run: {error.strerror or error}\n")


class AlsoTo:
    """A text stream that also writes to a Record, but for a progress bar's frames."""

    def __init__(self, stream, record: Record):
        self.stream, self.record = stream, record
        self.in_bar = False  # the last write was a bar's frame

    def write(self, text: str) -> int:
        if "\r" in text:  # a bar's frame: for the terminal only
            self.in_bar = True
        elif not (self.in_bar and not text.strip()):  # but the newline that ends a bar
            self.in_bar = False
            self.record.write(text, self.stream)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the terminal's
        return getattr(self.stream, name)
