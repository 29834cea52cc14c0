"""What produced a run (git commit, versions, launch, hosts), for checkpoints and the saved config; train.log."""

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

GIT_TIMEOUT = 10  # seconds for both git calls: a repository's own hooks or filters may hang
GIT_ENV = {"GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
NOT_ASKED = {"unknown": "git commit not recorded (provenance=false)"}


def describe_run(env: DistEnv, code: Path, record_git: bool = True) -> dict:
    """The same on every rank (one git call per job). Every rank must call this."""
    hosts = all_gather_objects(socket.gethostname())
    state = (git_state(code) if record_git else NOT_ASKED) if is_main() else None
    cuda = torch.cuda.is_available()
    return {
        "git": broadcast_from_main(state),
        "versions": {
            "python": platform.python_version(),
            "torch": str(torch.__version__),  # a str subclass, which a weights-only load refuses
            "torchvision": importlib.metadata.version("torchvision"),  # a dependency of the project
            "cuda": torch.version.cuda if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        },
        "launch": {"launcher": env.launcher, "world_size": env.world_size, "nodes": len(set(hosts))},
        "hosts": list(dict.fromkeys(hosts)),  # in rank order, each once
    }


class GitFailed(Exception): ...


def git_state(folder: Path, timeout: float = GIT_TIMEOUT) -> dict | None:
    """{"commit": sha, "dirty": bool}; None outside a repository; {"unknown": why} if git fails."""
    deadline = time.monotonic() + timeout
    try:
        head = git(folder, deadline, "rev-parse", "HEAD")
        if head is None:
            return None
        switches = filters_off(git(folder, deadline, "config", "--name-only", "--list") or "")
        return {"commit": head, "dirty": bool(git(folder, deadline, *switches, "status", "--porcelain"))}
    except subprocess.TimeoutExpired:
        return {"unknown": f"git state unknown: git did not answer within {timeout:g} s"}
    except GitFailed as error:
        return {"unknown": f"git state unknown: {error}"}


def filters_off(config_keys: str) -> list[str]:
    """`-c` switches that turn off every filter the configuration names (a clean filter runs on
    `git status`): git compares the files as they are, and runs no program of the repository's."""
    names = sorted({key[7:].rpartition(".")[0] for key in config_keys.splitlines() if key.startswith("filter.")})
    off = [f"filter.{name}.{key}=" for name in names for key in ("clean", "smudge", "process")]
    off += [f"filter.{name}.required=false" for name in names]
    return [word for setting in off for word in ("-c", setting)]


def git(folder: Path, deadline: float, *args: str) -> str | None:
    """None outside a repository. A session of its own: a timeout stops its children too."""
    try:
        command, env = ["git", "-c", "core.fsmonitor=false", *args], {**os.environ, **GIT_ENV}
        pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        process = subprocess.Popen(command, cwd=folder, env=env, text=True, start_new_session=True, **pipes)
    except OSError as error:
        why = "is not installed" if isinstance(error, FileNotFoundError) else f"cannot start: {error.strerror}"
        raise GitFailed(f"git {why}") from None
    with process:  # closes the pipes without reading on: what git started may hold them
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:  # the time limit, or a Ctrl-C meanwhile: nothing of git is left
            with contextlib.suppress(ProcessLookupError):  # the whole session's group: git's children too
                os.killpg(process.pid, signal.SIGKILL)
            raise
    if process.returncode == 0:
        return out.strip()
    if "not a git repository" in err:
        return None
    raise GitFailed(f"git {args[0]} failed: {(err.strip().splitlines() or [f'exit code {process.returncode}'])[0]}")


def commit_line(provenance: dict) -> str:
    state = provenance["git"]
    if state is None:
        return "no git commit (not a git repository)"
    if "unknown" in state:
        return state["unknown"]
    return f"commit {state['commit'][:12]}{' (uncommitted changes)' if state['dirty'] else ''}"


def header(provenance: dict, most_hosts: int = 8) -> str:
    launch, hosts = provenance["launch"], provenance["hosts"]
    shown = ", ".join(f"{name} {version}" for name, version in provenance["versions"].items() if version)
    more = f" and {len(hosts) - most_hosts} more" if len(hosts) > most_hosts else ""
    return (
        f"# produced by {commit_line(provenance)}\n# {shown}\n"
        f"# {launch['world_size']} process(es) on {launch['nodes']} node(s) ({launch['launcher']}): "
        f"{', '.join(hosts[:most_hosts])}{more}\n"
    )


def keep_output_in(path: Path) -> None:
    record = path.open("a", encoding="utf-8", buffering=1)  # a line at a time
    sys.stdout, sys.stderr = AlsoTo(sys.stdout, record), AlsoTo(sys.stderr, record)


class AlsoTo:
    """A stream also writing to a record file, bar frames aside; a failed write (full disk) ends the record."""

    def __init__(self, stream, record):
        self.stream, self.record = stream, record
        self.in_bar = False  # the last write was a bar's frame

    def write(self, text: str) -> int:
        if "\r" in text:  # a bar's frame: for the terminal only
            self.in_bar = True
        elif not (self.in_bar and not text.strip()):  # but the newline that ends a bar
            self.in_bar = False
            try:
                if not self.record.closed:  # both streams share it
                    self.record.write(text)
            except OSError as error:
                with contextlib.suppress(OSError):  # its buffer cannot go either
                    self.record.close()
                why = error.strerror or error
                self.stream.write(f"warning: {self.record.name} records no more of this run: {why}\n")
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the terminal's
        return getattr(self.stream, name)
