"""Streaming training data (engine/loader.py) and runs counted in steps.

The stream is tests/stream_task: the regression task's points read from a folder of 7
shards of uneven sizes, the shards shuffled per epoch, split across ranks and DataLoader
workers by shard, with a random augmentation. Every rank takes as many steps in an
epoch, the epochs end without a hang, and a run stopped mid-epoch continues bitwise.
"""

import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import threading

import pytest
import torch

from conftest import (
    PROJECT,
    clean_env,
    command,
    import_file,
    load_checkpoint,
    machinery_project,
    read_metrics,
    reference_config,
    run_script,
    tensors,
    wait_for_line,
)
from test_entry_points import ABORT, RUNS, assert_clean

STREAM_TASK = PROJECT / "tests" / "stream_task"
SHARD_SIZES = [40, 75, 23, 110, 61, 9, 88]  # 406 samples, one shard of 9
STREAM_RUN = [
    "train.max_steps=50",
    "train.eval_every_steps=20",
    "optim.warmup_steps=5",
    "optim.lr=0.05",
    "train.log_every_steps=10",
    "checkpoint.best_metric=val_mse",
]


@pytest.fixture(scope="module")
def stream_project(tmp_path_factory):
    project = tmp_path_factory.mktemp("stream") / "project"
    shutil.copytree(machinery_project(), project)
    shutil.copy(STREAM_TASK / "data.py", project / "data.py")
    shutil.copy(PROJECT / "tests" / "regression_task" / "model.py", project / "model.py")
    (project / "config.yaml").write_text("")
    stream_data().write_shards(project / "shards", SHARD_SIZES)
    return project


def stream_data():
    return import_file("stream_task_data", STREAM_TASK / "data.py")


def expected_steps(epoch: int, nproc: int, workers: int, batch_size: int, accum_steps: int) -> int:
    """Whole steps of the shortest rank share: reader k of n reads shards k, k + n, ... of
    the epoch's order, and drops its last partial batch."""
    order = list(range(len(SHARD_SIZES)))
    random.Random(0 * 1000 + epoch).shuffle(order)  # as ShardStream.shards, seed 0
    readers = max(workers, 1)
    parts = nproc * readers
    batches = [sum(SHARD_SIZES[i] for i in order[k::parts]) // batch_size for k in range(parts)]
    per_rank = [sum(batches[r * readers : (r + 1) * readers]) for r in range(nproc)]
    return min(per_rank) // accum_steps


@pytest.mark.parametrize(
    "nproc, workers, batch_size, accum_steps, stop_at",
    [(2, 2, 8, 1, 31), (3, 0, 4, 2, 17), (None, 2, 16, 1, 26)],
    ids=["2 processes x 2 workers", "3 processes, accumulation", "1 process"],
)
def test_a_stream_of_uneven_shards_takes_equal_steps_and_resumes_bitwise(
    stream_project, tmp_path, nproc, workers, batch_size, accum_steps, stop_at
):
    args = [
        *STREAM_RUN,
        f"train.num_workers={workers}",
        f"train.batch_size={batch_size}",
        f"train.accum_steps={accum_steps}",
    ]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run = lambda *more: run_script("train.py", [*args, *more], nproc=nproc, cwd=stream_project)  # noqa: E731
    out = run(f"output_dir={whole}").stdout
    epochs = [(int(e), int(s)) for e, s in re.findall(r"epoch (\d+) of the stream: (\d+) steps on every rank", out)]
    assert epochs, out
    world = nproc or 1
    assert epochs == [(e, expected_steps(e, world, workers, batch_size, accum_steps)) for e, _ in epochs]
    if world > 1:  # uneven shares: what the longer ones had left is said once
        assert out.count("micro-batches left out") == 1, out

    run(f"output_dir={split}", f"train.stop_at_step={stop_at}")
    ends = list(itertools.accumulate(steps for _, steps in epochs))
    epoch_at_stop = next(epoch for epoch, end in enumerate(ends) if stop_at <= end)
    assert f"epoch {epoch_at_stop}, step {stop_at}" in run(f"output_dir={split}").stdout
    a, b = (load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split))
    assert a["step"] == b["step"] == 50
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    vals = [[row["val_mse"] for row in read_metrics(out)] for out in (whole, split)]
    assert vals[0] == vals[1] and len(vals[0]) == 3  # steps 20, 40 and 50


def test_a_run_counted_in_steps_has_the_curve_of_one_counted_in_epochs(tmp_path, fast_args):
    """Evaluating every epoch's worth of steps gives the rows of an epoch-counted run; and
    evaluating more often changes nothing of the training."""
    fast = [*fast_args, "data.train_size=512"]
    steps = 512 // (16 * 2)  # per epoch, on 2 processes
    runs = {
        "epochs": ["train.epochs=3"],
        "steps": [f"train.max_steps={3 * steps}", f"train.eval_every_steps={steps}"],
        "often": [f"train.max_steps={3 * steps}", "train.eval_every_steps=5"],
    }
    for name, args in runs.items():
        run_script("train.py", [*fast, *args, f"output_dir={tmp_path / name}"], nproc=2)
    curve = lambda name: [  # noqa: E731
        {k: v for k, v in row.items() if k.startswith(("val_", "train_loss")) or k in ("epoch", "step", "lr")}
        for row in read_metrics(tmp_path / name)
    ]
    assert curve("steps") == curve("epochs") and len(curve("epochs")) == 3
    assert [row["step"] for row in curve("often")] == [5, 10, 15, 20, 25, 30, 35, 40, 45, 48]
    a, b = (load_checkpoint(tmp_path / name / "checkpoints" / "last.pt") for name in ("epochs", "often"))
    assert all(torch.equal(value, b["model"][key]) for key, value in a["model"].items())


def test_a_stop_during_a_step_evaluation_is_evaluated_by_the_next_run(tmp_path, fast_args):
    """A stop that lands at an evaluation's step leaves it to the next run, which does it
    before training on: the same rows as a run left alone."""
    args = [*fast_args, "data.train_size=512", "train.max_steps=24", "train.eval_every_steps=12"]
    run_script("train.py", [*args, f"output_dir={tmp_path / 'whole'}"], nproc=2)
    split = [*args, f"output_dir={tmp_path / 'split'}"]
    run_script("train.py", [*split, "train.stop_at_step=12"], nproc=2)  # the stop comes before the evaluation
    assert not (tmp_path / "split" / "metrics.jsonl").exists()
    run_script("train.py", split, nproc=2)
    val = lambda name: [row["val_loss"] for row in read_metrics(tmp_path / name)]  # noqa: E731
    assert val("split") == val("whole") and len(val("whole")) == 2


def test_a_validation_stream_is_refused_in_one_line(stream_project, tmp_path):
    data = stream_project / "data.py"
    source = data.read_text()
    data.write_text(source.replace('ShardsInMemory(sorted(folder.glob("val-*.pt")))', "ShardStream([], 0, 0)"))
    try:
        result = run_script("train.py", [*STREAM_RUN, f"output_dir={tmp_path}"], cwd=stream_project, check=False)
    finally:
        data.write_text(source)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: the validation set is a stream (an IterableDataset); evaluation needs a map-style Dataset (len() "
        "and indexing), so that every sample counts once with the same result on any number of processes: return "
        "one from build_datasets (e.g. the validation shards read into memory)"
    ]


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["train.max_steps=0"], "set train.max_steps, the run's length in optimizer steps"),
        (["optim.warmup_steps=null"], "whose epochs have no known length; set optim.warmup_steps"),
        (["optim.schedule=step"], "optim.schedule=step counts epochs"),
        (["train.batch_size=400"], "the training stream gave a rank no whole optimizer step in epoch 0"),
    ],
    ids=["no max_steps", "warmup in epochs", "step schedule", "no whole step"],
)
def test_a_stream_with_settings_that_count_epochs_is_refused_in_one_line(stream_project, tmp_path, overrides, error):
    args = [*STREAM_RUN, "train.num_workers=0", *overrides, f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=2, cwd=stream_project, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and error in lines[0], result.stderr[-2000:]


def test_the_stream_example_in_the_docs_is_the_one_tested():
    """docs/streaming.md's ShardStream is tests/stream_task's, line for line."""
    docs = (PROJECT / "docs" / "streaming.md").read_text()
    block = re.search(r"```python\n(class ShardStream.*?)```", docs, flags=re.S).group(1)
    assert block.strip() in (STREAM_TASK / "data.py").read_text()


def test_steps_and_epochs_keys_check_their_values():
    for key in ("train.max_steps=-1", "train.eval_every_steps=-5"):
        with pytest.raises(Exception, match=key.split("=")[0]):
            reference_config(None, [key])


@pytest.mark.slow  # an entry point under real torchrun: the slow tier (pytest -m slow)
def test_a_stream_run_exits_clean_under_torchrun(stream_project, tmp_path):
    """Its DataLoader workers start anew each epoch, and a stop leaves them mid-epoch:
    they must end before the process group does."""
    args = [*STREAM_RUN, "train.num_workers=2", "train.batch_size=8", "train.stop_at_step=30"]  # in epoch 1
    for run in range(RUNS):
        out = tmp_path / str(run)
        result = run_script(
            "train.py", [*args, f"output_dir={out}"], nproc=2, cwd=stream_project, check=False, real_launcher=True
        )
        assert_clean(result)
        assert "epoch 0 of the stream: 24 steps" in result.stdout and "stopped at step 30" in result.stdout


# The stream of the tests, but rank 1's reader hangs after 40 samples (5 steps of 8): a
# stuck file system, a reader waiting on a socket.
HANGING_STREAM = """
import threading

_build_datasets = build_datasets


def build_datasets(cfg):
    train, val = _build_datasets(cfg)
    return HangsOnRankOne(train), val


class HangsOnRankOne(IterableDataset):
    def __init__(self, stream):
        self.stream = stream

    def set_epoch(self, epoch):
        self.stream.set_epoch(epoch)

    def __iter__(self):
        return self.split(0, 1)

    def split(self, part, parts):
        for count, sample in enumerate(self.stream.split(part, parts)):
            if part == 1 and count == 40:
                threading.Event().wait()
            yield sample
"""


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_a_rank_whose_stream_hangs_stops_the_run_within_the_step_timeout(stream_project, tmp_path):
    """The other rank waits in the stream's vote for equal steps: that wait is bounded by
    dist.step_timeout_minutes like every collective after the first step, not torch's
    30-minute default, and ends in the one line that names the setting."""
    project = tmp_path / "project"
    shutil.copytree(stream_project, project)
    (project / "data.py").write_text((project / "data.py").read_text() + HANGING_STREAM)
    args = [*STREAM_RUN, "train.num_workers=0", "train.batch_size=8", "dist.step_timeout_minutes=0.05"]
    process = subprocess.Popen(
        command("train.py", [*args, f"output_dir={tmp_path / 'run'}"], nproc=2),
        cwd=project,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the hung rank ends with the test, not 30 s after torchrun's SIGTERM
    )
    # A run that hangs prints nothing: the reading below then ends when this ends the run.
    watchdog = threading.Timer(90, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    seen = []
    try:
        line = wait_for_line(process, "lost contact with another process", seen)
    finally:
        watchdog.cancel()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert line.startswith("rank 0 stopped: lost contact") and "dist.step_timeout_minutes" in line, line
    assert not ABORT.search("".join(seen)), "".join(seen)
