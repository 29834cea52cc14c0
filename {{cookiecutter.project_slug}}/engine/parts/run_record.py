"""What produced a run (git commit, versions, launch, hosts), for checkpoints and the saved config; train.log;
each rank's last collectives when one fails (the flight recorder); gloo's address checked on a multi-node job."""

import contextlib
import importlib.metadata
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import check_positive
from engine.distributed import DistEnv, all_gather_objects, broadcast_from_main, get_rank, is_main, whole_number
from engine.errors import UsageError
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {
    "provenance": "run_record.provenance",
    "dist.flight_recorder_entries": "run_record.flight_recorder_entries",
}

GIT_TIMEOUT = 10  # seconds for both git calls: a repository's own hooks or filters may hang
GIT_ENV = {"GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
PROJECT = Path(__file__).resolve().parents[2]  # the folder of train.py, whose git state is recorded
NOT_ASKED = {"unknown": "git commit not recorded (run_record.provenance=false)"}
# The flight recorder's variables under the names older PyTorch releases read.
OLDER_NAMES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}


@dataclass
class Section:
    provenance: bool = True  # record the git commit: runs git in the project folder; false: no git call
    flight_recorder_entries: int = 2000  # collectives each rank keeps for output_dir/flight_recorder (0: off)

    def __post_init__(self):
        check_positive("run_record.flight_recorder_entries", self.flight_recorder_entries, allow_zero=True)


def build(cfg, env: DistEnv) -> "RunRecord":
    return RunRecord(cfg, env)


class RunRecord(Part):
    name = "run_record"

    def __init__(self, cfg, env: DistEnv):
        self.env, self.record_git = env, cfg.run_record.provenance
        self.trace_entries = cfg.run_record.flight_recorder_entries
        self.trace_dir = Path(cfg.output_dir) / "flight_recorder"
        self.provenance: dict | None = None

    def output_dir_held(self, output_dir: str) -> None:
        record = (Path(output_dir) / "train.log").open("a", encoding="utf-8", buffering=1)  # a line at a time
        sys.stdout, sys.stderr = AlsoTo(sys.stdout, record), AlsoTo(sys.stderr, record)  # rank 0's, across resumes
        if self.trace_entries:  # NCCL's watchdog writes there (output_dir is shared), but does not make the folder
            self.trace_dir.mkdir(parents=True, exist_ok=True)

    def setup(self, state) -> None:
        self.provenance = describe_run(self.env, PROJECT, self.record_git)  # git commit, versions, hosts

    def state_dict(self) -> dict:
        return self.provenance  # what produced this checkpoint; a resumed run keeps its own

    def config_header(self) -> str:
        most_hosts = 8  # named; the rest counted
        launch, hosts = self.provenance["launch"], self.provenance["hosts"]
        shown = ", ".join(f"{name} {version}" for name, version in self.provenance["versions"].items() if version)
        more = f" and {len(hosts) - most_hosts} more" if len(hosts) > most_hosts else ""
        return (
            f"# produced by {commit_line(self.provenance)}\n# {shown}\n"
            f"# {launch['world_size']} process(es) on {launch['nodes']} node(s) ({launch['launcher']}): "
            f"{', '.join(hosts[:most_hosts])}{more}\n"
        )

    def open_log(self, start_step: int) -> None:
        log(f"produced by {commit_line(self.provenance)}")

    def process_group_env(self, env: DistEnv) -> dict[str, str]:
        check_gloo_address(socket.gethostname(), multi_node(os.environ), os.environ)
        return flight_recorder_env(os.environ, self.trace_entries, self.trace_dir)

    def lost_peer(self, error: BaseException) -> None:
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", os.environ.get(OLDER_NAMES["TORCH_FR_DUMP_TEMP_FILE"]))
        if not prefix:
            return
        trace = Path(f"{prefix}{get_rank()}")
        dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)  # no public API yet
        if dump is not None and not trace.exists():  # unless NCCL's watchdog has; before leaving the groups it names
            with contextlib.suppress(OSError):
                trace.parent.mkdir(parents=True, exist_ok=True)
                trace.write_bytes(dump())
        if trace.exists():
            error.add_note(f"Its last collectives: {trace}.")


def flight_recorder_env(environ: Mapping[str, str], trace_entries: int, trace_dir: Path) -> dict[str, str]:
    """Each rank keeps its last `trace_entries` collectives and writes them to `trace_dir`/rank_N when one times
    out (read them with `python -m torch.distributed.flight_recorder.fr_trace`); under either name, the launch's win."""
    if not trace_entries:
        return {}
    wanted = {"TORCH_FR_BUFFER_SIZE": str(trace_entries), "TORCH_FR_DUMP_TEMP_FILE": f"{trace_dir}/rank_"}
    return {name: value for name, value in wanted.items() if OLDER_NAMES.get(name, name) not in environ} | {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"
    }


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

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding: the terminal's (the record is line-buffered)
        return getattr(self.stream, name)


def multi_node(environ: Mapping[str, str]) -> bool:
    fix = "the launcher sets it to a whole number; unset yours"
    if "LOCAL_WORLD_SIZE" in environ and "WORLD_SIZE" in environ:
        return whole_number(environ, "LOCAL_WORLD_SIZE", fix) < whole_number(environ, "WORLD_SIZE", fix)
    nodes = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in environ else "SLURM_NNODES"
    return (whole_number(environ, nodes, fix) or 1) > 1


def check_gloo_address(hostname: str, spans_hosts: bool, environ: Mapping[str, str]) -> None:
    """gloo listens where the host name resolves, often 127.0.1.1 in containers: say so before it hangs."""
    if not spans_hosts or "GLOO_SOCKET_IFNAME" in environ:
        return
    address = ""  # unresolvable: gloo falls back to the loopback address
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(hostname)
    if not address or address.startswith("127."):
        raise UsageError(
            f"this host's name {hostname!r} resolves to {address or 'nothing'}, which other nodes cannot reach; "
            "set GLOO_SOCKET_IFNAME to the interface between the nodes (e.g. GLOO_SOCKET_IFNAME=eth0 or ib0; "
            "`ip -br addr` lists them)"
        )
