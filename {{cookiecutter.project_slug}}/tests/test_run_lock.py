"""One run per output_dir: a second run refuses before writing; a lock left by a dead
run never blocks the next launch. Real processes, then the stale-lock rules one by one."""

import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import FAST, children, run_script, start_script, wait_for_line
from engine import lifecycle
from engine.lifecycle import LOCK_NAME, STALE_S, OutputDirInUse, RunLock

LONG = [*FAST, "data.train_size=8192", "train.log_every_steps=1", "train.epochs=50"]
# The multi-node command of the README on one node: a fixed run id, each launch its own store.
MYJOB = ("--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--rdzv_id=myjob")


def start_long_run(out, torchrun_args=()):
    process, seen = start_script("train.py", [*LONG, f"output_dir={out}"], nproc=2, torchrun_args=torchrun_args), []
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
    """A 2-process run that trains on in the background, launched with --rdzv_id=myjob."""
    out = tmp_path_factory.mktemp("busy") / "run"
    process = start_long_run(out, MYJOB)
    yield out, process
    kill_job(process)


@pytest.mark.slow  # a 2-process run trains in the background meanwhile: the slow tier (pytest -m slow)
@pytest.mark.parametrize(
    "nproc, torchrun_args",
    [(None, ()), (2, ()), (2, MYJOB)],
    ids=["python", "torchrun", "torchrun-same-rdzv-id"],
)
def test_a_second_run_on_a_busy_output_dir_refuses_before_writing(running, nproc, torchrun_args):
    out, first = running
    second = [*FAST, f"output_dir={out}", "train.epochs=7"]
    result = run_script("train.py", second, nproc=nproc, torchrun_args=torchrun_args, check=False, real_launcher=True)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.returncode != 0, result.stderr
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] in children(first.pid)  # rank 0 of the first run holds it
    assert errors[0].startswith(f"error: output_dir '{out}' is in use by the run on host {holder['host']}, ")
    assert f"pid {holder['pid']}, started {holder['started']}" in errors[0]
    assert "epochs: 7" not in (out / "config.yaml").read_text()  # the second run wrote nothing


@pytest.mark.slow  # the slow tier (pytest -m slow)
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
    dead = subprocess.Popen(["true"])
    dead.communicate()
    lock_held_by(tmp_path, host=os.uname().nodename, pid=dead.pid)
    RunLock(tmp_path).acquire().release()


def test_a_lock_of_a_killed_process_not_yet_reaped_is_taken_over(tmp_path):
    """A rank killed with its launcher stays a zombie until init reaps it."""
    zombie = subprocess.Popen(["true"])  # not waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 10
        while not lifecycle.zombie(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        lock_held_by(tmp_path, host=os.uname().nodename, pid=zombie.pid)
        RunLock(tmp_path).acquire().release()
    finally:
        zombie.wait()


def test_a_lock_with_this_process_pid_is_a_dead_holders(tmp_path):
    """In a container the run gets the same pid at every start (1 in Docker); on a stable
    host name (a Kubernetes pod restarting its container), the killed run's lock names it."""
    lock_held_by(tmp_path, host=os.uname().nodename, pid=os.getpid())
    RunLock(tmp_path).acquire().release()


def as_torchrun_rank_0(monkeypatch, run_id="f00d", store=("node-0", "4711")):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for variable, value in zip(("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"), (run_id, *store), strict=True):
        monkeypatch.setenv(variable, value)


@pytest.fixture
def live_pid():
    """A live process of this host, other than this one: a holder that no pid check finds dead."""
    sleeper = subprocess.Popen(["sleep", "600"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait()


def write_holder(directory, holder):
    (directory / LOCK_NAME).write_text(json.dumps(holder))


@pytest.mark.parametrize(
    "slurm_job, torchrun, count",
    [
        ("812", False, "SLURM_RESTART_COUNT"),  # a requeued SLURM job
        (None, True, "TORCHELASTIC_RESTART_COUNT"),  # an elastic restart
        ("812", True, "TORCHELASTIC_RESTART_COUNT"),  # an elastic restart of srun torchrun
    ],
    ids=["requeue", "elastic-restart", "elastic-restart-in-a-slurm-job"],
)
def test_a_live_run_of_the_same_launch_is_refused_whatever_its_restart_count_until_its_pid_ends(
    tmp_path, monkeypatch, live_pid, slurm_job, torchrun, count
):
    """Two runs of one SLURM job (two terminals of one salloc) or one torchrun launch share
    their launch. On this host a live holder is never taken over, even by a later start of
    the launch (a higher restart count: only an environment variable, anyone can set it; a
    real requeue or elastic restart starts once the earlier processes have ended)."""
    as_torchrun_rank_0(monkeypatch)
    if not torchrun:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    if slurm_job:
        monkeypatch.setenv("SLURM_JOB_ID", slurm_job)
    monkeypatch.setenv(count, "1")
    holder = {**RunLock(tmp_path).me, "pid": live_pid}
    write_holder(tmp_path, holder)
    for restarts in ("1", "2"):
        monkeypatch.setenv(count, restarts)
        with pytest.raises(OutputDirInUse, match=f"in use by the run on host {holder['host']}, pid {live_pid}, "):
            RunLock(tmp_path).acquire()
    os.kill(live_pid, signal.SIGKILL)
    os.waitpid(live_pid, 0)
    RunLock(tmp_path).acquire().release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_faked_restart_count_beside_a_live_run_of_the_same_job_is_refused(tmp_path):
    """`SLURM_RESTART_COUNT=1 python train.py` beside a live run of job 4242 on this host: it
    must neither take the lock nor touch the run's files."""
    out = tmp_path / "run"
    first, seen = start_script("train.py", [*LONG, f"output_dir={out}"], env={"SLURM_JOB_ID": "4242"}), []
    try:
        wait_for_line(first, "step 2 ", seen)
        holder = (out / LOCK_NAME).read_text()
        faked = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}
        second = run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=7"], env=faked, check=False)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(f"error: output_dir '{out}' is in use by the run on host "), second.stderr
        assert (out / LOCK_NAME).read_text() == holder and first.poll() is None
    finally:
        first.kill()
        first.communicate()


@pytest.mark.parametrize(
    "variable, other",
    [
        ("SLURM_JOB_ID", "8121"),  # another job
        ("TORCHELASTIC_RUN_ID", "f00d1"),  # another run id
        ("MASTER_PORT", "4712"),  # another store: another torchrun launch, in the same SLURM job
    ],
)
def test_a_later_start_of_another_launch_is_refused(tmp_path, monkeypatch, live_pid, variable, other):
    as_torchrun_rank_0(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    write_holder(tmp_path, {**RunLock(tmp_path).me, "pid": live_pid})
    monkeypatch.setenv(variable, other)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    with pytest.raises(OutputDirInUse):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("content", ["", "{", "null", '{"launch": ""}'])
def test_an_unreadable_lock_is_named_and_taken_over_once_nothing_refreshes_it(tmp_path, content):
    """An empty run.lock (an older version's, a crashed file system's) names no holder."""
    path = tmp_path / LOCK_NAME
    path.write_text(content)
    with pytest.raises(OutputDirInUse) as refused:
        RunLock(tmp_path).acquire()
    assert str(refused.value) == (
        f"output_dir '{tmp_path}' may be in use: its {LOCK_NAME} is empty or unreadable, as a run of an older "
        f"version of this project may leave it (it is taken over {STALE_S / 60:g} minutes after its last change); "
        f"if no run uses that folder, delete {path}"
    )
    then = time.time() - STALE_S - 1
    os.utime(path, (then, then))
    RunLock(tmp_path).acquire().release()
    assert not path.exists()


def beating(path, beats=10, every_s=0.2):
    """A live holder's heartbeat for a while: the lock's modification time moves on. Then it
    stops, so a watch that missed the beats would end up taking the lock over."""
    for _ in range(beats):
        time.sleep(every_s)
        os.utime(path)


@pytest.mark.parametrize("alive", [True, False])
def test_the_same_run_id_from_another_store_and_host_is_watched(tmp_path, monkeypatch, alive):
    """Rank 0 of an elastic restart may come up on another node, with a new store; so may
    rank 0 of a second launch with the same --rdzv_id. A heartbeat tells them apart."""
    as_torchrun_rank_0(monkeypatch, store=("node-3", "5050"))
    monkeypatch.setattr(lifecycle, "STALE_S", 3.0)
    monkeypatch.setattr(lifecycle, "WATCH_S", 0.1)
    path = lock_held_by(tmp_path, launch="torchrun:f00d@node-0:4711", age_s=1.0)
    if alive:
        heartbeat = threading.Thread(target=beating, args=(path,))
        heartbeat.start()
        with pytest.raises(OutputDirInUse, match="in use by the run on host node-7"):
            RunLock(tmp_path).acquire()
        heartbeat.join()
    else:  # not stale when first seen (1 s old of 3): taken over only by waiting
        RunLock(tmp_path).acquire().release()
        assert not path.exists()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock(tmp_path).acquire()
    lock_held_by(tmp_path)  # taken over meanwhile
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "node-7"
