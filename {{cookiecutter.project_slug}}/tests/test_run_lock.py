"""One run per output_dir: a second run refuses before writing; a lock left by a dead
run never blocks the next launch. Real processes, then the stale-lock rules one by one."""

import contextlib
import json
import os
import signal
import time

import pytest

from conftest import FAST, children, run_script, start_script, wait_for_line
from engine.run_lock import LOCK_NAME, STALE_S, OutputDirInUse, RunLock

LONG = [*FAST, "data.train_size=8192", "train.log_every_steps=1", "train.epochs=50"]


def start_long_run(out):
    process, seen = start_script("train.py", [*LONG, f"output_dir={out}"], nproc=2), []
    wait_for_line(process, "step 2 ", seen)
    return process


def kill_job(process):
    """SIGKILL to torchrun and its workers: the whole job at once, as a dead node."""
    for pid in [process.pid, *children(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.communicate()


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """A 2-process run that trains on in the background."""
    out = tmp_path_factory.mktemp("busy") / "run"
    process = start_long_run(out)
    yield out, process
    kill_job(process)


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_second_run_on_a_busy_output_dir_refuses_before_writing(running, nproc):
    out, first = running
    result = run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=7"], nproc=nproc, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.returncode != 0, result.stderr
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] in children(first.pid)  # rank 0 of the first run holds it
    assert errors[0].startswith(f"error: output_dir '{out}' is in use by the run on host {holder['host']}, ")
    assert f"pid {holder['pid']}, started {holder['started']}" in errors[0]
    assert "epochs: 7" not in (out / "config.yaml").read_text()  # the second run wrote nothing


def test_a_lock_left_by_a_killed_run_does_not_block_the_next_launch(tmp_path):
    out = tmp_path / "run"
    kill_job(start_long_run(out))
    assert (out / LOCK_NAME).is_file()  # nobody removed it
    result = run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=1"], nproc=2)
    assert "resumed from" in result.stdout or "training on" in result.stdout
    assert not (out / LOCK_NAME).exists()  # released at the end


def lock_held_by(directory, age_s=0.0, **holder):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "earlier", "launch": "", **holder}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_fresh_lock_of_another_host_is_obeyed(tmp_path):
    lock_held_by(tmp_path)
    with pytest.raises(OutputDirInUse, match="in use by the run on host node-7, pid 4242"):
        RunLock(tmp_path).acquire()


def test_a_lock_whose_heartbeat_stopped_is_taken_over(tmp_path):
    """Another node's pid cannot be looked up; a lock not refreshed for STALE_S seconds
    is a dead node's."""
    lock_held_by(tmp_path, age_s=STALE_S + 1)
    lock = RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_of_a_dead_pid_on_this_host_is_taken_over(tmp_path):
    dead = start_script("train.py", ["--help"])
    dead.communicate()
    lock_held_by(tmp_path, host=os.uname().nodename, pid=dead.pid)
    RunLock(tmp_path).acquire().release()


@pytest.mark.parametrize(
    "variable, value, launch",
    [("SLURM_JOB_ID", "812", "slurm:812"), ("TORCHELASTIC_RUN_ID", "f00d", "torchrun:f00d")],
)
def test_the_same_launch_restarted_takes_its_lock_over(tmp_path, monkeypatch, variable, value, launch):
    """A requeued SLURM job or an elastic restart: its earlier processes are gone or going."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv(variable, value)
    lock_held_by(tmp_path, launch=launch)
    RunLock(tmp_path).acquire().release()
    lock_held_by(tmp_path, launch=launch + "1")  # another job
    with pytest.raises(OutputDirInUse):
        RunLock(tmp_path).acquire()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock(tmp_path).acquire()
    lock_held_by(tmp_path)  # taken over meanwhile
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"
