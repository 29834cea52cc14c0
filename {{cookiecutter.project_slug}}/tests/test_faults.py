"""Faults with real processes: signals, kills, torn and hostile files, bad input.

Nothing is lost beyond the last checkpoint, and each failure says what happened in one line.
"""

import json
import math
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import (
    FAST,
    STRATEGIES,
    children,
    clean_env,
    command,
    finish,
    free_port,
    has,
    last_wins,
    machinery_project,
    project_with,
    read_metrics,
    replaced,
    run_script,
    start_script,
    strategy_args,
    wait_for_line,
)
from engine.checkpoint import load_checkpoint, save_checkpoint, step_checkpoints
from engine.lifecycle import (
    NoteComparison,
    pid_alive,  # alive and not a zombie (an orphan may wait unreaped)
)

# Long enough epochs that a signal lands mid-epoch; runs end at train.stop_at_step.
LONG = [*FAST, "data.train_size=8192", "train.log_every_steps=1", "data.augment=true", "model.dropout=0.1"]
END = 300


def last(output_dir):
    return load_checkpoint(output_dir / "checkpoints" / "last.pt")


def assert_same_state(a, b):
    assert (a["epoch"], a["batches_done"], a["step"]) == (b["epoch"], b["batches_done"], b["step"])
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key
    for index, slots in a["optimizer"]["state"].items():
        for name, value in slots.items():
            assert torch.equal(b["optimizer"]["state"][index][name], value), (index, name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 2 processes straight to step END."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_script("train.py", [*LONG, f"output_dir={out}", f"train.stop_at_step={END}"], nproc=2)
    return last(out)


# -- 1. atomic checkpoints ---------------------------------------------------------------

KILLED_SAVE = """
import sys, time, torch
from pathlib import Path
from engine.checkpoint import atomic_write, save_checkpoint
directory = Path(sys.argv[1])
save_checkpoint({"model": {"w": torch.ones(3)}, "step": 1}, directory, step=1, keep_last=3, is_best=False)

def slow_write(f):
    f.write(b"x" * 100_000)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)

atomic_write(directory, "step-00000002.pt", slow_write)
"""


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_process_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    saver = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path)], cwd=machinery_project(), stdout=subprocess.PIPE, text=True
    )
    assert saver.stdout.readline().strip() == "writing"
    saver.kill()
    saver.wait()
    leftovers = list(tmp_path.glob(".*.tmp"))
    assert leftovers, "the torn write should still be on disk"
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000001.pt"]
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 1
    save_checkpoint({"model": {}, "step": 3}, tmp_path, step=3, keep_last=3, is_best=False)
    assert not list(tmp_path.glob(".*.tmp"))  # cleaned up by the next save


# -- 2. corrupt checkpoints -----------------------------------------------------------------


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_corrupt_last_falls_back_to_older_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = [*FAST, f"output_dir={out}", "checkpoint.every_steps=20", "checkpoint.keep_last=5"]
    run_script("train.py", [*args, "train.stop_at_step=50"])
    directory = out / "checkpoints"
    (directory / "last.pt").unlink()  # last.pt shares its data with step 50: replace, not truncate
    (directory / "last.pt").write_bytes((directory / "step-00000050.pt").read_bytes()[:2000])
    (directory / "step-00000050.pt").write_bytes(b"garbage")
    resumed = run_script("train.py", [*args, "train.stop_at_step=60"])
    assert resumed.stdout.count("warning: checkpoint") == 2
    assert f"resumed from {directory / 'step-00000040.pt'}: epoch 0, step 40" in resumed.stdout
    assert last(out)["step"] == 60


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("content", [b"", b"garbage", None])
def test_explicit_bad_checkpoint_is_one_line_exit_2(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is not None:
        path.write_bytes(content)
    result = run_script("train.py", [*FAST, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={path}"], check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint '{path}'"), result.stderr


# -- 3. hostile checkpoints -------------------------------------------------------------------


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_checkpoint_that_runs_code_is_refused_by_train_py(tmp_path):
    marker, evil = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCode(marker)}, evil, pickle_module=pickle)
    result = run_script("train.py", [*FAST, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={evil}"], check=False)
    assert result.returncode == 2 and "error: checkpoint" in result.stderr
    assert not marker.exists()


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_own_checkpoints_hold_no_unsafe_globals(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, f"output_dir={out}", "train.stop_at_step=5", "optim.name=adamw"], nproc=2)
    for path in (out / "checkpoints").glob("*.pt"):
        assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []


# -- 4. preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, sig, workers",
    [
        ("worker", signal.SIGUSR1, 0),  # the one in a plain pytest run: a stop, its line, exit 75, a resume
        pytest.param("worker", signal.SIGHUP, 0, marks=pytest.mark.slow),  # a closed terminal
        pytest.param("worker", signal.SIGQUIT, 0, marks=pytest.mark.slow),  # Ctrl-\\
        pytest.param("agent", signal.SIGINT, 0, marks=pytest.mark.slow),
        # torchrun signals each rank's process group, SLURM each task's: DataLoader workers too
        pytest.param("agent", signal.SIGTERM, 2, marks=pytest.mark.slow),
        pytest.param("worker's process group", signal.SIGUSR1, 2, marks=pytest.mark.slow),
    ],
)
def test_stop_signal_checkpoints_and_resumes_exactly(tmp_path, uninterrupted, target, sig, workers):
    out = tmp_path / "run"
    args = [*LONG, f"output_dir={out}", f"train.stop_at_step={END}", f"train.num_workers={workers}"]
    process, seen = start_script("train.py", args, nproc=2), []
    wait_for_line(process, "step 5 ", seen)
    victim = process.pid if target == "agent" else children(process.pid)[-1]
    sent = time.monotonic()
    if target.endswith("process group"):
        os.killpg(victim, sig)
    else:
        os.kill(victim, sig)
    output = finish(process, seen)
    took = time.monotonic() - sent
    stop_line = [line for line in output.splitlines() if line.startswith("stopped at step")]
    assert len(stop_line) == 1, output
    stopped_at = last(out)["step"]
    assert 5 <= stopped_at < END and f"stopped at step {stopped_at} by" in stop_line[0]
    assert took < 20, f"stopping took {took:.1f} s; torchrun kills after 30 s"
    # Workers exit cleanly (a signalled torchrun agent prints its own traceback).
    assert f'File "{machinery_project()}' not in output

    run_script("train.py", args, nproc=2)
    assert_same_state(uninterrupted, last(out))


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_a_second_ctrl_c_while_the_run_stops_is_one_line(tmp_path):
    """The first Ctrl-C stops with a checkpoint; a second one during the teardown (the
    DataLoader workers' shutdown, the save) stops at once, in one line, no traceback."""
    out = tmp_path / "run"
    args = [*LONG, f"output_dir={out}", "train.num_workers=2"]
    process, seen = start_script("train.py", args), []
    wait_for_line(process, "step 3 ", seen)
    process.send_signal(signal.SIGINT)
    wait_for_line(process, "stopped at step", seen)
    process.send_signal(signal.SIGINT)  # lands in the teardown
    output = finish(process, seen)
    assert "Traceback" not in output and "Exception ignored" not in output, output
    assert process.returncode in (75, 130), output  # stopped with the first Ctrl-C's checkpoint, or at once
    if process.returncode == 130:
        assert output.splitlines()[-1] == (
            "error: stopped at once by a second Ctrl-C; run the same command to continue from the last checkpoint"
        )
    assert last(out)["step"] >= 3  # the first Ctrl-C's checkpoint


# Short training, long evaluation (seconds, also on an idle machine): 24,000 samples in batches of 2.
LONG_EVAL = [
    *FAST,
    "data.train_size=512",
    "data.val_size=24000",
    "train.eval_batch_size=2",
    "train.epochs=2",
    "train.log_every_steps=1",
    "data.augment=true",
    "model.dropout=0.1",
]


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_the_ranks_compare_stop_notes_at_most_twice_as_far_apart_as_last_time(tmp_path):
    """Rank 0 proposes the next count to compare notes at from the rate since the last
    comparison. A burst of rounds (an evaluation's first, prefetched batches) once made it
    propose a count past the evaluation's end, so a stop during it went unseen: the
    interval now grows at most twofold."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comparison, count, intervals = NoteComparison(dist.new_group(backend="gloo")), 0, []
        for _ in range(6):  # called at once, one after another: the fastest rate there is
            assert not comparison.any_noted(False, count)
            intervals.append(comparison.next_check - count)
            count = comparison.next_check
        assert intervals == [1, 2, 4, 8, 16, 32]
        assert comparison.any_noted(True, count)
    finally:
        dist.destroy_process_group()


def test_a_stop_during_evaluation_saves_the_last_step_and_the_next_run_evaluates_again(tmp_path):
    """A requeue must not wait for an evaluation of any length: the stop is agreed between
    evaluation batches, the checkpoint is the last training step's, and the relaunch
    evaluates that epoch again and ends bitwise as a run never stopped."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_script("train.py", [*LONG_EVAL, f"output_dir={whole}"], nproc=2)
    process, seen = start_script("train.py", [*LONG_EVAL, f"output_dir={split}"], nproc=2), []
    steps = int(wait_for_line(process, "steps/epoch", seen).split("; ")[-1].split()[0])
    wait_for_line(process, f"epoch 0 step {steps} ", seen)  # the epoch's last step: its evaluation follows
    # Past that step's own stop check (a signal there stops before the evaluation, as it
    # should): its 6,000 batches per rank take seconds.
    time.sleep(0.5)
    os.kill(process.pid, signal.SIGTERM)
    output = finish(process, seen)
    assert "the evaluation of epoch 0 stopped; the next run evaluates it again" in output, output
    assert f"stopped at step {steps} by SIGTERM" in output
    assert not (split / "metrics.jsonl").exists()  # no row for an epoch not evaluated
    stopped = last(split)
    assert (stopped["epoch"], stopped["step"], stopped["batches_done"]) == (0, steps, steps)

    resumed = run_script("train.py", [*LONG_EVAL, f"output_dir={split}"], nproc=2).stdout
    assert "resumed from" in resumed
    assert_same_state(last(whole), last(split))
    a, b = read_metrics(whole), read_metrics(split)
    assert [row["val_loss"] for row in a] == [row["val_loss"] for row in b]
    assert math.isnan(b[0]["train_loss"])  # epoch 0 was trained by the stopped run


# -- 5. crashed ranks -------------------------------------------------------------------------

# The documented launch for restarts: the agent's shared TCP store can go stale across
# restarts (pytorch/pytorch#135712); each round then gets its own store.
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("victim", ["rank 0, the output_dir lock holder", "another rank"])
def test_killed_worker_is_restarted_and_finishes_exactly(tmp_path, uninterrupted, victim):
    out = tmp_path / "run"
    args = [*LONG, f"output_dir={out}", f"train.stop_at_step={END}", "checkpoint.every_steps=25"]
    process, seen = start_script("train.py", args, nproc=2, env=RESTART_ENV, torchrun_args=["--max-restarts=2"]), []
    wait_for_line(process, "step 60 ", seen)
    holder = json.loads((out / "run.lock").read_text())["pid"]  # rank 0's: its restart must take the lock over
    others = [pid for pid in children(process.pid) if pid != holder]
    os.kill(holder if victim.startswith("rank 0") else others[0], signal.SIGKILL)
    output = finish(process, seen, timeout=180)
    assert process.returncode == 0, output
    assert "resumed from" in output
    assert_same_state(uninterrupted, last(out))


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def left_after(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running `seconds` from now (or once all are gone), then
    killed, so that a failing test leaves nothing behind."""
    deadline = time.monotonic() + seconds
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid in pids if pid_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def uninterrupted_with_workers(tmp_path_factory):
    """The reference with 2 DataLoader workers per rank (they draw the augmentation)."""
    out = tmp_path_factory.mktemp("uninterrupted_with_workers")
    args = [*LONG, f"output_dir={out}", f"train.stop_at_step={END}", "train.num_workers=2"]
    run_script("train.py", args, nproc=2)
    return last(out)


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dead_launcher_leaves_no_process_and_loses_no_step(tmp_path, request, workers):
    """SIGKILL to torchrun's agent: nothing tells its workers (they sit in sessions of their
    own). They notice the loss of their parent, stop together with a checkpoint at their
    last step, and exit with their DataLoader workers; the relaunch ends bitwise."""
    out = tmp_path / "run"
    args = [*LONG, f"output_dir={out}", f"train.stop_at_step={END}", f"train.num_workers={workers}"]
    log = tmp_path / "log.txt"
    with log.open("w") as sink:  # not a pipe: orphans writing to a pipe nobody reads would block
        agent = subprocess.Popen(
            command("train.py", args, nproc=2),
            cwd=machinery_project(),
            env=clean_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while "step 5 " not in log.read_text() and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.2)
    run = descendants(agent.pid)
    assert len(run) >= 2 + 2 * workers, log.read_text()  # ranks and their DataLoader workers
    agent.kill()
    agent.wait()
    left = left_after(run, seconds=60)
    output = log.read_text()
    assert not left, f"{len(left)} processes of the run still there 60 s after the agent died\n{output}"
    stopped_at = last(out)["step"]
    assert 5 <= stopped_at < END
    assert f"stopped at step {stopped_at} by the loss of its launcher; checkpoint saved" in output

    run_script("train.py", args, nproc=2)
    reference = request.getfixturevalue("uninterrupted_with_workers" if workers else "uninterrupted")
    assert_same_state(reference, last(out))


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_a_killed_single_process_run_leaves_no_dataloader_worker(tmp_path):
    """`python train.py` killed with -9: its DataLoader workers see their parent gone and exit."""
    args = [*LONG, f"output_dir={tmp_path / 'run'}", "train.num_workers=2"]
    process, seen = start_script("train.py", args), []
    wait_for_line(process, "step 5 ", seen)
    workers = descendants(process.pid)
    assert len(workers) >= 2
    process.kill()
    process.communicate()
    left = left_after(workers, seconds=60)
    assert not left, f"{len(left)} DataLoader workers still there 60 s after their rank died"


# -- 6. no hangs ------------------------------------------------------------------------------


def start_rank(rank, args, port):
    env = clean_env(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    return subprocess.Popen(
        [sys.executable, "train.py", *last_wins(args)],
        cwd=machinery_project(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_a_lost_rank_fails_the_others_within_the_step_timeout_and_leaves_their_history(tmp_path, fault):
    # No torchrun here: it would kill the survivors itself. The survivor must not hang for
    # the setup's 30 minutes (dist.timeout_minutes): after the first step, 6 s apply.
    output_dir = tmp_path / "run"
    args = [*LONG, f"output_dir={output_dir}", "train.stop_at_step=100000", "dist.step_timeout_minutes=0.1"]
    port = free_port()
    survivor, victim = start_rank(0, args, port), start_rank(1, args, port)
    try:
        wait_for_line(survivor, "step 3 ", [])
        victim.send_signal(fault)
        _, stderr = survivor.communicate(timeout=120)
    finally:
        victim.kill()
        victim.wait()
    assert survivor.returncode == 1
    assert "rank 0 stopped: lost contact with another process" in stderr
    assert "Traceback" not in stderr
    if fault == signal.SIGSTOP:  # a hang: gloo's own timeout, the step's, not the setup's
        assert "6000ms" in stderr, stderr
    if has("engine/parts/run_record.py"):
        # The run_record part's flight recorder: the survivor's last collectives, the failed one among them.
        trace = output_dir / "flight_recorder" / "rank_0"
        assert f"Its last collectives: {trace}." in stderr
        entries = pickle.loads(trace.read_bytes())["entries"]
        assert entries and all(entry["profiling_name"].startswith("gloo:") for entry in entries)
        assert entries[-1]["state"] != "completed"


# -- 7. bad input -----------------------------------------------------------------------------


def one_error_line(result):
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    return errors[0]


def test_the_line_of_an_error_every_rank_raises_is_out_even_when_rank_0_is_the_last_to_raise_it(tmp_path):
    # Rank 0 reaches the bad value a second after rank 1: were rank 1 to exit at once, the
    # launcher would stop rank 0 before it says why.
    start = "    args = parse_args(argv)\n"
    late_rank_0 = start + "    time.sleep(1.5 if is_main() else 0)\n"
    project = project_with(tmp_path, {"train.py": lambda text: replaced(text, [(start, late_rank_0)])})
    args = [*FAST, f"output_dir={tmp_path / 'run'}", "train.epochs=-1"]
    result = run_script("train.py", args, nproc=2, check=False, cwd=project)
    assert one_error_line(result) == "error: train.epochs must be > 0, got -1"


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize(
    "args, message",
    [
        (["train.precision=fp16"], "error: train.precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU"),
        (["data.name=imagefolder", "data.root=/nonexistent"], "error: data.root: '/nonexistent/train' is missing"),
        (["model.name=vit"], "error: unknown model.name 'vit': choose resnet18 or mlp, or add yours in model.py"),
    ],
)
def test_bad_values_are_one_line_from_two_ranks(tmp_path, args, message):
    args = [*FAST, f"output_dir={tmp_path / 'run'}", *args]
    result = run_script("train.py", args, nproc=2, check=False)
    assert one_error_line(result).startswith(message)


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_bad_values_under_torchrun_are_one_line(tmp_path):
    """Under torchrun itself, a value found bad once the ranks have met (here, the data's
    folder) is one line too: test_train.py has one found before they meet."""
    args = [*FAST, f"output_dir={tmp_path / 'run'}", "data.name=imagefolder", "data.root=/nonexistent"]
    result = run_script("train.py", args, nproc=2, check=False, real_launcher=True)
    assert one_error_line(result).startswith("error: data.root: '/nonexistent/train' is missing")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_yaml_syntax_error_names_the_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("optim:\n  lr: 0.1\n  momentum: [2\n")
    result = run_script("train.py", ["--config", config], check=False)
    assert result.returncode == 2
    assert one_error_line(result).startswith(f"error: {config} line 4: YAML syntax error")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_missing_config_file(tmp_path):
    result = run_script("train.py", ["--config", tmp_path / "nope.yaml"], check=False)
    assert result.returncode == 2
    assert one_error_line(result) == f"error: config file '{tmp_path / 'nope.yaml'}' not found (pass --config PATH)"


def make_image_folder(root, bad_image=False, empty_class=False, bad_name="7.png"):
    from PIL import Image

    for split in ("train", "val"):
        for label in ("cat", "dog"):
            folder = root / split / label
            folder.mkdir(parents=True)
            if empty_class and split == "train" and label == "dog":
                continue
            for i in range(24):
                Image.new("RGB", (10, 10), (i * 10, 100 if label == "cat" else 0, 0)).save(folder / f"{i}.png")
    if bad_image:
        (root / "train" / "cat" / bad_name).write_bytes(b"not a png")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_imagefolder_trains(tmp_path):
    make_image_folder(tmp_path / "images")
    out = tmp_path / "run"
    args = [
        *FAST,
        "data.name=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "train.batch_size=8",
        f"output_dir={out}",
    ]
    run_script("train.py", [*args, "train.epochs=1"])
    assert read_metrics(out)[0]["num_samples"] == 48


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_empty_class_folder_is_named(tmp_path):
    make_image_folder(tmp_path / "images", empty_class=True)
    args = [*FAST, "data.name=imagefolder", f"data.root={tmp_path / 'images'}", f"output_dir={tmp_path / 'run'}"]
    line = one_error_line(run_script("train.py", args, nproc=2, check=False))  # every rank fails: one line
    assert line.startswith(f"error: data.root: class folder '{tmp_path / 'images' / 'train' / 'dog'}' has no images")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_unreadable_image_is_named_from_a_worker(tmp_path):
    make_image_folder(tmp_path / "images", bad_image=True)
    args = [
        *FAST,
        "data.name=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "train.num_workers=2",
        "train.batch_size=8",
    ]
    result = run_script("train.py", [*args, f"output_dir={tmp_path / 'run'}"], nproc=2, check=False)
    bad = tmp_path / "images" / "train" / "cat" / "7.png"
    assert one_error_line(result).startswith(f"error: image {bad} is not an image PIL can read")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_unreadable_image_on_rank_1_is_reported_by_rank_1(tmp_path):
    # With seed 0, 8.png is in rank 1's first batch: rank 0 never sees the error itself.
    make_image_folder(tmp_path / "images", bad_image=True, bad_name="8.png")
    args = [*FAST, "data.name=imagefolder", f"data.root={tmp_path / 'images'}", "train.batch_size=8"]
    result = run_script("train.py", [*args, f"output_dir={tmp_path / 'run'}"], nproc=2, check=False)
    bad = tmp_path / "images" / "train" / "cat" / "8.png"
    assert one_error_line(result).startswith(f"error: rank 1: image {bad} is not an image PIL can read")


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_checkpoint_of_another_model_names_key_and_shapes(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, f"output_dir={out}", "train.stop_at_step=2"])
    args = [*FAST, "model.hidden_dim=64", f"checkpoint.init_from={out / 'checkpoints' / 'last.pt'}"]
    line = one_error_line(run_script("train.py", [*args, f"output_dir={tmp_path / 'ft'}"], check=False))
    assert "'net.2.linear.weight' has shape (32, 192) in the checkpoint but (64, 192) in the model" in line


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_unwritable_output_dir_stops_every_rank_at_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_script("train.py", [*FAST, f"output_dir={blocker / 'run'}"], nproc=2, check=False, timeout=60)
    assert one_error_line(result).startswith(f"error: cannot access '{blocker / 'run'}")


def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_failed_save_is_clear_and_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, f"output_dir={out}", "train.stop_at_step=3"])
    before = (out / "checkpoints" / "last.pt").read_bytes()
    # A file-size limit makes the next checkpoint write fail part-way (EFBIG); the real full
    # disk, where this machine may mount one, is the test below.
    result = subprocess.run(
        [sys.executable, "train.py", *FAST, f"output_dir={out}", "train.stop_at_step=6"],
        cwd=machinery_project(),
        env=clean_env(),
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
    )
    line = one_error_line(result)
    assert result.returncode == 2
    assert line.startswith("error: checkpoint not saved (cannot write") and "earlier checkpoints are intact" in line
    assert (out / "checkpoints" / "last.pt").read_bytes() == before
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == 3
    assert not list((out / "checkpoints").glob(".*.tmp"))


# -- 7b. divergence ------------------------------------------------------------------------

# lr 300 without clipping: finite for a few steps of the warmup, then NaN (at step 8 to 10
# on 1 or 2 processes). keep_last=1: a run that saved NaN would prune every good checkpoint.
DIVERGING = [
    *FAST,
    "optim.lr=300",
    "optim.scale_lr=false",
    "train.grad_clip=0",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=1",
    "train.epochs=2",
]


def all_finite(checkpoint: dict) -> bool:
    return all(torch.isfinite(value).all() for value in checkpoint["model"].values() if value.is_floating_point())


LAYOUTS = [(None, "ddp"), (2, "ddp"), (2, "fsdp")]


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("nproc, strategy", [case for case in LAYOUTS if case[-1] in STRATEGIES])
def test_a_diverging_run_stops_every_rank_and_keeps_its_last_good_checkpoint(tmp_path, nproc, strategy):
    args = [*DIVERGING, *strategy_args(strategy), f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=nproc, check=False)
    line = one_error_line(result)
    good = last(tmp_path)
    assert line.startswith("error: training diverged: non-finite gradients at step "), line
    bad_step = int(line.split("at step ")[1].split(";")[0])
    assert good["step"] < bad_step <= good["step"] + 2 * 4  # caught at the next check (log or save)
    assert f"last.pt (step {good['step']}), kept" in line and "learning rate (this run's: 300;" in line
    assert all_finite(good) and good["step"] > 0
    suffix = "dcp" if strategy == "fsdp" else "pt"  # FSDP saves sharded folders
    assert [path.name for path in step_checkpoints(tmp_path / "checkpoints")] == [f"step-{good['step']:08d}.{suffix}"]
    assert not (tmp_path / "checkpoints" / "best.pt").exists()  # no epoch finished


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_bad_steps_are_skipped_up_to_max_bad_steps_then_the_run_stops(tmp_path):
    args = [*DIVERGING, "train.max_bad_steps=3", f"output_dir={tmp_path}"]
    result = run_script("train.py", args, check=False)
    line = one_error_line(result)
    assert "after 3 skipped (train.max_bad_steps)" in line, line
    assert all_finite(last(tmp_path))


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_a_diverging_run_resumed_stops_at_once_without_saving(tmp_path):
    """The last good checkpoint stays the resume point: a relaunch (a requeue) diverges
    again from it, and still writes nothing non-finite."""
    run_script("train.py", [*DIVERGING, f"output_dir={tmp_path}"], check=False)
    before = last(tmp_path)["step"]
    result = run_script("train.py", [*DIVERGING, f"output_dir={tmp_path}"], check=False)
    assert "resumed from" in result.stdout and "training diverged" in one_error_line(result)
    assert last(tmp_path)["step"] == before and all_finite(last(tmp_path))


def contents(path: Path) -> dict[str, bytes]:
    """A checkpoint's bytes: a file's, or each file's in a sharded checkpoint's folder."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {path.name: path.read_bytes()}


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.parametrize("nproc, strategy", [case for case in LAYOUTS if case[-1] in STRATEGIES])
def test_a_full_disk_fails_the_save_in_one_line_keeps_the_last_checkpoint_and_resumes(small_disk, nproc, strategy):
    out, args = small_disk / "run", [*FAST, *strategy_args(strategy)]
    run_script("train.py", [*args, f"output_dir={out}", "train.stop_at_step=3"], nproc=nproc)
    before = contents(out / "checkpoints" / "last.pt")
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler = small_disk / "filler"
    size = sum(map(len, before.values()))
    filler.write_bytes(b"\0" * (free - size // 2))  # room for logs, not for a checkpoint
    result = run_script("train.py", [*args, f"output_dir={out}", "train.stop_at_step=6"], nproc=nproc, check=False)
    line = one_error_line(result)
    assert line.startswith("error: checkpoint not saved (cannot write") and "No space left on device" in line, line
    assert contents(out / "checkpoints" / "last.pt") == before
    assert not list((out / "checkpoints").glob(".*.tmp"))

    filler.unlink()
    result = run_script("train.py", [*args, f"output_dir={out}", "train.stop_at_step=6"], nproc=nproc)
    assert "resumed from" in result.stdout and last(out)["step"] == 6


# -- 8. runs are not overwritten ----------------------------------------------------------------


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_resume_with_changed_model_is_refused(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=1"])
    result = run_script("train.py", [*FAST, f"output_dir={out}", "model.hidden_dim=64"], check=False)
    assert result.returncode == 2
    line = one_error_line(result)
    assert "was trained with other settings (model.hidden_dim: 32 -> 64)" in line
    assert "checkpoint.init_from=" in line
    assert len(read_metrics(out)) == 1
