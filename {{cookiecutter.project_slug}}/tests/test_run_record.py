"""What a run leaves about itself (engine/parts/run_record.py): what produced it (the git
commit and whether the code differed from it, the versions, the launch and its hosts), in
every checkpoint, the saved config's header and the run's opening line; and rank 0's
lines, in output_dir/train.log across resumes."""

import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import FAST, load_checkpoint, machinery_project, reference_config, run_script
from engine.distributed import DistEnv, process_group_env
from engine.errors import UsageError
from engine.parts.run_record import (
    check_gloo_address,
    commit_line,
    describe_run,
    flight_recorder_env,
    git_state,
    multi_node,
)
from test_distributed import SRUN_TASK

RUN = [*FAST, "data.train_size=256", "train.epochs=1"]


def git(folder, *args) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    return subprocess.run(["git", *identity, *args], cwd=folder, check=True, capture_output=True, text=True).stdout


def test_a_run_records_its_commit_versions_and_hosts_in_a_repository_and_outside(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(machinery_project(), repo)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the project")
    head = git(repo, "rev-parse", "HEAD").strip()

    runs = {"clean": repo, "outside": machinery_project()}
    for name, project in runs.items():
        out = tmp_path / name
        opening = run_script(str(project / "train.py"), [*RUN, f"output_dir={out}"], nproc=2, cwd=project).stdout
        ckpt = load_checkpoint(out / "checkpoints" / "last.pt")
        record = ckpt["states"]["run_record"]
        assert record["versions"]["torch"] == torch.__version__
        assert record["versions"]["python"] == platform.python_version()
        assert record["launch"] == {"launcher": "torchrun", "world_size": 2, "nodes": 1}
        assert record["hosts"] == [socket.gethostname()]
        saved = (out / "config.yaml").read_text()
        assert yaml.safe_load(saved)["output_dir"] == str(out)  # the header is comments: the config still loads
        if name == "clean":
            assert record["git"] == {"commit": head, "dirty": False}
            assert f"commit {head[:12]}" in opening and saved.startswith(f"# produced by commit {head[:12]}\n")
        else:
            assert record["git"] is None
            assert "no git commit (not a git repository)" in opening

    with (repo / "model.py").open("a") as f:
        f.write("# an edit not yet committed\n")
    out = tmp_path / "dirty"
    opening = run_script(str(repo / "train.py"), [*RUN, f"output_dir={out}"], cwd=repo).stdout
    record = load_checkpoint(out / "checkpoints" / "last.pt")["states"]["run_record"]
    assert record["git"] == {"commit": head, "dirty": True}
    assert f"commit {head[:12]} (uncommitted changes)" in opening


def test_rank_0s_lines_go_to_train_log_across_resumes_with_the_error_that_ends_a_run(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "train.epochs=2", "train.log_every_steps=2", f"output_dir={out}"]
    first = run_script("train.py", [*args, "train.stop_at_step=5"], nproc=2).stdout
    second = run_script("train.py", args, nproc=2).stdout
    failed = run_script("train.py", [*args, "checkpoint.best_metric=val_nope"], nproc=2, check=False)
    assert failed.returncode != 0  # 2 from each rank; torchrun says 1

    logged = (out / "train.log").read_text().splitlines()
    printed = [*first.splitlines(), *second.splitlines()]
    assert [line for line in logged if line in printed] == printed  # every line, in order
    assert "stopped at step 5" in first and "resumed from" in second
    assert logged[-1] == [line for line in failed.stderr.splitlines() if line.startswith("error: ")][-1]
    assert logged[-1].startswith("error: checkpoint.best_metric is 'val_nope'")


# The git call is the project folder's own code running: a repository's settings may name
# commands (core.fsmonitor, a filter). It runs without the ones it can turn off, on a
# short leash, and not at all with provenance=false.


def committed_repo(tmp_path) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text("# the project\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the project")
    return repo, git(repo, "rev-parse", "HEAD").strip()


def script(path: Path, text: str) -> Path:
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(0o755)
    return path


def fake_git(tmp_path, monkeypatch, text: str) -> None:
    """A `git` first on PATH that runs `text`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script(bin_dir / "git", text)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_git_call_runs_no_fsmonitor_command_of_the_repository(tmp_path):
    repo, head = committed_repo(tmp_path)
    marker = tmp_path / "fsmonitor-ran"
    git(repo, "config", "core.fsmonitor", str(script(tmp_path / "fsmonitor", f"touch {marker}")))
    assert git_state(repo) == {"commit": head, "dirty": False}
    assert not marker.exists()


@pytest.mark.parametrize("name", ["mark", "a.b"])  # a filter's name may hold dots
def test_the_git_call_runs_no_filter_of_the_repository_and_still_sees_a_change(tmp_path, name):
    repo, head = committed_repo(tmp_path)
    marker = tmp_path / "filter-ran"
    (repo / ".gitattributes").write_text(f"*.py filter={name}\n")
    git(repo, "add", ".gitattributes")
    git(repo, "commit", "-q", "-m", "attributes")
    head = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "config", f"filter.{name}.clean", str(script(tmp_path / "clean", f"touch {marker}; cat")))
    git(repo, "config", f"filter.{name}.required", "true")
    os.utime(repo / "model.py", (1, 1))  # changed as far as its time says: git reads it to know
    assert git_state(repo) == {"commit": head, "dirty": False}
    (repo / "model.py").write_text("# the project, edited\n")
    assert git_state(repo) == {"commit": head, "dirty": True}
    assert not marker.exists()


def gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_git_that_hangs_is_stopped_with_what_it_started_and_the_run_says_so(tmp_path, monkeypatch):
    child = tmp_path / "child.pid"
    fake_git(tmp_path, monkeypatch, f"sleep 600 &\necho $! > {child}\nwait")
    state = git_state(tmp_path, timeout=1)
    assert commit_line({"git": state}) == "git state unknown: git did not answer within 1 s"
    pid = int(child.read_text())
    deadline = time.monotonic() + 10  # the kill is sent; its delivery is the kernel's
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert gone(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # nothing left behind by a failure


@pytest.mark.parametrize(
    "case, line",
    [
        ("outside a repository", "no git commit (not a git repository)"),
        (
            "a broken repository",
            "git state unknown: git rev-parse failed: fatal: bad config line 1 in file .git/config",
        ),
        ("no git", "git state unknown: git is not installed"),
    ],
)
def test_why_a_run_has_no_commit_is_said_truthfully(tmp_path, monkeypatch, case, line):
    folder = tmp_path / "project"
    folder.mkdir()
    if case == "a broken repository":
        folder, _ = committed_repo(tmp_path)
        (folder / ".git" / "config").write_text("[core\n")
    elif case == "no git":
        monkeypatch.setenv("PATH", str(tmp_path / "no-such-folder"))
    assert commit_line({"git": git_state(folder)}) == line


def test_provenance_false_runs_no_git(tmp_path, monkeypatch):
    repo, _ = committed_repo(tmp_path)
    marker = tmp_path / "git-ran"
    fake_git(tmp_path, monkeypatch, f"touch {marker}\nexit 1")
    record = describe_run(DistEnv(), repo, record_git=False)
    assert commit_line(record) == "git commit not recorded (run_record.provenance=false)"
    assert not marker.exists()
    assert reference_config(None, ["run_record.provenance=false"]).run_record.provenance is False


# Multi-node jobs and the flight recorder's variables, set before the process group is joined.


def test_process_group_variables_connect_gloo_lazily_and_record_collectives():
    trace_dir = Path("/runs/a/flight_recorder")
    assert process_group_env({}, flight_recorder_env({}, 2000, trace_dir)) == {
        "TORCH_GLOO_LAZY_INIT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/flight_recorder/rank_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    # Off: only the lazy connections.
    assert process_group_env({}, flight_recorder_env({}, 0, trace_dir)) == {"TORCH_GLOO_LAZY_INIT": "1"}


def test_process_group_variables_set_at_launch_win_under_either_name():
    launch = {
        "TORCH_GLOO_LAZY_INIT": "0",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "10",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/",
    }
    wanted = flight_recorder_env(launch, 2000, Path("/runs/a/fr"))
    assert process_group_env(launch, wanted) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


@pytest.mark.parametrize(
    "environ, spans_hosts",
    [
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "2"}, False),  # this step, not the job
        ({**SRUN_TASK, "SLURM_NNODES": "2"}, True),
        ({}, False),
    ],
)
def test_multi_node_jobs_are_told_from_single_node_ones(environ, spans_hosts):
    assert multi_node(environ) is spans_hosts


@pytest.mark.parametrize(
    "environ, name",
    [
        ({**SRUN_TASK, "SLURM_NNODES": "two"}, "SLURM_NNODES"),
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "", "SLURM_NNODES": "2"}, "SLURM_STEP_NUM_NODES"),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "-8", "LOCAL_WORLD_SIZE": "8"}, "WORLD_SIZE"),
    ],
)
def test_a_node_count_that_is_no_number_is_one_line(environ, name):
    with pytest.raises(UsageError) as error:
        multi_node(environ)
    fix = "the launcher sets it to a whole number; unset yours"
    assert str(error.value) == f"{name} is {environ[name]!r}, not a whole number: {fix}"


def test_a_multi_node_job_on_a_loopback_host_name_is_told_to_set_gloo_socket_ifname():
    with pytest.raises(UsageError, match=r"'localhost' resolves to 127\.0\.0\.1.*set GLOO_SOCKET_IFNAME"):
        check_gloo_address("localhost", True, {})
    check_gloo_address("localhost", False, {})  # one host: loopback reaches every rank
    check_gloo_address("localhost", True, {"GLOO_SOCKET_IFNAME": "lo"})  # the user chose
