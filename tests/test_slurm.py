"""The generated project on a real single-node SLURM cluster (slurmctld + slurmd + munge
started here by slurm_cluster.sh): srun, the shipped sbatch script, and preemption with
requeue. Skipped with the reason where SLURM cannot run; in CI (CI=true) that is an error.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TOOLS_ENV, bake

CLUSTER = Path(__file__).with_name("slurm_cluster.sh")
# The generated project's small and fast settings (its tests/conftest.py has the same).
FAST = (
    "model.name=mlp model.hidden_dim=32 data.image_size=8 data.train_size=1024 data.val_size=101 "
    "train.num_workers=0 train.batch_size=16 data.augment=false"
).split()


def fast(*changes: str) -> list[str]:
    """FAST with `changes` (key=value) in place of its own settings of those keys: the
    config refuses a key given twice on the command line."""
    changed = {change.partition("=")[0] for change in changes}
    return [setting for setting in FAST if setting.partition("=")[0] not in changed] + list(changes)


# The shipped script asks for GPUs; this cluster has none. Adapted by variables, not edits.
NO_GPU = {"SBATCH_GPUS_PER_NODE": "0"}
ONE_NODE_TWO_TASKS = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
# One cluster on this machine: under pytest-xdist, every test here runs on the same worker.
pytestmark = pytest.mark.xdist_group("slurm")


def unavailable(reason):
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("the SLURM tests need root to install and start slurmctld/slurmd")
    directory = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", CLUSTER, "start", directory], capture_output=True, text=True, timeout=900)
    if started.returncode != 0:
        unavailable(f"SLURM did not start: {started.stderr.strip()[-800:]}")
    env = {**TOOLS_ENV, "SLURM_CONF": str(directory / "slurm.conf")}  # srun's `python` first on PATH
    try:
        yield env
    finally:
        subprocess.run(["bash", CLUSTER, "stop", directory], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return bake(tmp_path_factory.mktemp("bake"))


def job_info(job_id, env) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_srun_two_tasks_train(slurm, project, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        ["srun", "-n", "2", "python", "train.py", *FAST, "train.epochs=1", f"output_dir={out}"],
        cwd=project,
        env=slurm,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "training on 2 process(es)" in result.stdout
    assert (out / "checkpoints" / "last.pt").is_file()
    assert '"num_samples": 101' in (out / "metrics.jsonl").read_text()


def test_shipped_sbatch_script_trains(slurm, project, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            *ONE_NODE_TWO_TASKS,
            "scripts/slurm/train.sbatch",
            *FAST,
            "train.epochs=1",
            f"output_dir={out}",
        ],
        cwd=project,
        env={**slurm, **NO_GPU},
        capture_output=True,
        text=True,
        timeout=300,
    )
    job_id = result.stdout.strip().split(";")[0]
    log = (project / f"slurm-{job_id}.out").read_text()
    assert result.returncode == 0, result.stderr + log
    assert "training on 2 process(es)" in log and "epoch 0:" in log


def test_a_job_array_trains_one_combination_of_a_grid_per_task(slurm, project, tmp_path):
    """sbatch --array with the shipped script: each task asks sweep.py for its settings and
    output_dir; the table shows both runs."""
    grid = ["--out", str(tmp_path / "grid"), *FAST, "train.epochs=1", "optim.lr=0.05,0.1"]
    one_task = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"]
    result = subprocess.run(
        ["sbatch", "--wait", "--parsable", "--array=0-1", *one_task, "scripts/slurm/train.sbatch", *grid],
        cwd=project,
        env={**slurm, **NO_GPU},
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = [log.read_text() for log in sorted(project.glob("slurm-*.out"))]
    tasks = [log for log in logs if "(array task " in log and str(tmp_path) in log]
    assert result.returncode == 0 and len(tasks) == 2, result.stderr + "".join(tasks)
    assert all("training on 1 process(es)" in log and "epoch 0:" in log for log in tasks), "".join(tasks)
    shown = subprocess.run(
        ["python", "sweep.py", "--table", *grid], cwd=project, env=slurm, capture_output=True, text=True, timeout=60
    )
    rows = [row.split() for row in shown.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["optim.lr=0.05", "optim.lr=0.1"], shown.stdout + shown.stderr
    assert all(row[1] == "val_acc" and 0 < float(row[2]) <= 1 for row in rows), shown.stdout


def submit(project, slurm, sbatch_options, args) -> str:
    submitted = subprocess.run(
        ["sbatch", "--parsable", *ONE_NODE_TWO_TASKS, *sbatch_options, "scripts/slurm/train.sbatch", *args],
        cwd=project,
        env={**slurm, **NO_GPU},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return submitted.stdout.strip().split(";")[0]


def test_usr1_before_time_limit_checkpoints_requeues_and_finishes(slurm, project, tmp_path):
    out = tmp_path / "run"
    args = [*fast("data.train_size=8192"), "train.log_every_steps=5", "train.epochs=2", f"output_dir={out}"]
    job_id = submit(project, slurm, [], args)
    log = project / f"slurm-{job_id}.out"
    wait_until(lambda: log.is_file() and "step 20 " in log.read_text(), 120, "step 20 in the log")
    # What SLURM does at --signal=B:USR1@90: signal the batch script.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm, check=True)
    wait_until(lambda: "JobState=COMPLETED" in job_info(job_id, slurm), 240, "the requeued job to finish")

    text = log.read_text()
    assert "Restarts=1" in job_info(job_id, slurm)
    assert "stopped at step" in text and "by SIGUSR1; checkpoint saved" in text
    assert f"job {job_id} run 1" in text and "resumed from" in text
    assert "epoch 1:" in text
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_signal_before_a_time_limit_during_evaluation_requeues_and_the_job_finishes(slurm, project, tmp_path):
    # What the shipped script asks SLURM for before its time limit (--signal=B:USR1), sent
    # while the epoch's evaluation runs: SLURM's own timer sends it up to a minute early, so
    # the test sends it when the evaluation has begun (2 s after the last step's line; the
    # evaluation of 50,000 samples one at a time takes far longer). The time limit of 2
    # minutes stays, and the stop must beat it; SLURM's own signal is moved to its last second.
    out = tmp_path / "run"
    settings = fast("data.train_size=512", "data.val_size=50000")
    args = [*settings, "train.eval_batch_size=1", "train.log_every_steps=1", f"output_dir={out}"]
    job_id = submit(project, slurm, ["--time=2", "--signal=B:USR1@1"], [*args, "train.epochs=1"])
    log = project / f"slurm-{job_id}.out"
    wait_until(lambda: log.is_file() and "epoch 0 step 16 " in log.read_text(), 120, "the epoch's last step")
    time.sleep(2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm, check=True)
    wait_until(lambda: "requeueing job" in log.read_text(), 100, "the requeue")
    # The next run evaluates the epoch again: give it the time it needs.
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], env=slurm, check=True)
    wait_until(lambda: "JobState=COMPLETED" in job_info(job_id, slurm), 400, "the requeued job to finish")

    text = log.read_text()
    assert "Restarts=1" in job_info(job_id, slurm) and "DUE TO TIME LIMIT" not in text
    assert "the evaluation of epoch 0 stopped; the next run evaluates it again" in text
    assert "stopped at step 16 by SIGUSR1; checkpoint saved" in text
    assert f"job {job_id} run 1" in text and "resumed from" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(row["epoch"], row["num_samples"]) for row in rows] == [(0, 50000)]  # evaluated once, in full


def srun(project, slurm, args, tasks=2):
    return subprocess.run(
        ["srun", "-n", str(tasks), "python", "train.py", *FAST, *args],
        cwd=project,
        env=slurm,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stdout + result.stderr
    return errors[0]


def test_srun_a_diverging_run_stops_every_task_and_keeps_a_finite_checkpoint(slurm, project, tmp_path):
    out = tmp_path / "run"
    diverging = ["optim.lr=300", "optim.scale_lr=false", "train.grad_clip=0", "checkpoint.every_steps=4"]
    result = srun(project, slurm, [*diverging, "checkpoint.keep_last=1", f"output_dir={out}"])
    assert one_error_line(result).startswith("error: training diverged: non-finite gradients at step ")
    good = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert good["step"] > 0 and all(torch.isfinite(value).all() for value in good["model"].values())


def test_srun_a_second_job_on_a_busy_output_dir_refuses(slurm, project, tmp_path):
    out = tmp_path / "run"
    long_run = [*fast("data.train_size=8192"), "train.epochs=50", f"output_dir={out}"]
    first = subprocess.Popen(
        ["srun", "-n", "1", "-J", "lock-holder", "python", "train.py", *long_run],
        cwd=project,
        env=slurm,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: (out / "metrics.jsonl").exists() or (out / "config.yaml").exists(), 120, "the first job")
        line = one_error_line(srun(project, slurm, [f"output_dir={out}"], tasks=1))
        assert line.startswith(f"error: output_dir '{out}' is in use by the run on host "), line
    finally:
        subprocess.run(["scancel", "-n", "lock-holder"], env=slurm, check=False)
        first.wait(timeout=120)


def test_srun_a_full_disk_fails_the_save_in_one_line_and_the_next_job_resumes(slurm, project, tmp_path):
    """A real 1 MiB tmpfs that fills up (these tests run as root, so they may mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run"
        assert srun(project, slurm, ["train.stop_at_step=3", f"output_dir={out}"]).returncode == 0
        before = (out / "checkpoints" / "last.pt").read_bytes()
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (free - len(before) // 2))  # room for logs, not for a checkpoint
        line = one_error_line(srun(project, slurm, ["train.stop_at_step=6", f"output_dir={out}"]))
        assert line.startswith("error: checkpoint not saved (cannot write") and "No space left on device" in line
        assert (out / "checkpoints" / "last.pt").read_bytes() == before
        filler.unlink()
        resumed = srun(project, slurm, ["train.stop_at_step=6", f"output_dir={out}"])
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
