"""Nothing the run wrote is lost or torn: metrics.jsonl on a full disk and after a
resume from an earlier checkpoint, the run lock on a full disk."""

import errno
import json
import os
import subprocess

import pytest

from conftest import FAST, finish, read_metrics, run_script, start_script, wait_for_line
from engine.errors import UsageError
from engine.files import append_json_line
from engine.lifecycle import RunLock

TWO_EPOCHS = [*FAST, "data.train_size=256", "train.epochs=2"]


def fill(disk, leave_pages: int = 0) -> None:
    """Take every free block of the file system but `leave_pages` of 4 KiB."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    os.truncate(filler, max(0, filler.stat().st_size - 4096 * leave_pages))


def one_error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    return errors[0]


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_a_full_disk_during_a_metrics_row_leaves_whole_rows_and_the_next_run_writes_each_epoch_once(small_disk):
    out = small_disk / "run"
    args = [*FAST, "data.train_size=4096", "train.log_every_steps=1", f"output_dir={out}"]
    run_script("train.py", [*args, "train.epochs=1"])
    metrics = out / "metrics.jsonl"
    # Rows up to a few bytes short of a page: the next row needs a block the disk will not have.
    rows = metrics.read_text()
    padding = {"step": 0, "note": ""}
    padding["note"] = "x" * (4096 - 10 - len(rows) - len(json.dumps(padding)) - 1)
    metrics.write_text(rows + json.dumps(padding) + "\n")
    before = metrics.read_bytes()

    process, seen = start_script("train.py", [*args, "train.epochs=2"]), []
    wait_for_line(process, "epoch 1 step 258 ", seen)
    fill(small_disk)  # the disk fills up while epoch 1 trains
    output = finish(process, seen)
    assert process.returncode == 2 and f"error: cannot write '{metrics}': No space left on device" in output, output
    assert metrics.read_bytes() == before  # no torn row

    (small_disk / "filler").unlink()
    run_script("train.py", [*args, "train.epochs=2"])
    assert [row["epoch"] for row in read_metrics(out) if "epoch" in row] == [0, 1]


def test_a_resume_from_an_earlier_checkpoint_sets_later_rows_aside(tmp_path):
    out = tmp_path / "run"
    args = [*TWO_EPOCHS, "train.epochs=3", "checkpoint.keep_last=5", f"output_dir={out}"]
    run_script("train.py", args, nproc=2)
    first_epoch_end = read_metrics(out)[0]["step"]
    earlier = out / "checkpoints" / f"step-{first_epoch_end:08d}.pt"

    result = run_script("train.py", [*args, f"checkpoint.resume={earlier}"], nproc=2)
    assert "2 line(s)" in result.stdout and "metrics.rewound.jsonl" in result.stdout
    assert [row["epoch"] for row in read_metrics(out)] == [0, 1, 2]  # each epoch once
    rewound = [json.loads(line) for line in (out / "metrics.rewound.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rewound] == [1, 2]  # kept, not deleted


def test_a_torn_row_is_set_aside_when_the_run_continues(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, "train.epochs=1", f"output_dir={out}"])
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"epoch": 1, "st')  # a machine that lost power mid-row
    run_script("train.py", [*FAST, "train.epochs=2", f"output_dir={out}"])
    assert [row["epoch"] for row in read_metrics(out)] == [0, 1]
    assert (out / "metrics.rewound.jsonl").read_text() == '{"epoch": 1, "st\n'


def test_a_failed_append_names_the_file_and_leaves_it_as_it_was(small_disk):
    path = small_disk / "rows.jsonl"
    path.write_text('{"step": 1}\n')
    fill(small_disk)
    with pytest.raises(UsageError, match=f"cannot write '{path}': No space left on device"):
        append_json_line(path, {"step": 2, "pad": "x" * 10_000})
    assert path.read_text() == '{"step": 1}\n'


def test_a_run_lock_that_cannot_be_written_is_not_left_behind(small_disk):
    out = small_disk / "run"
    out.mkdir()
    fill(small_disk)
    # tmpfs has no free inode limit here but no free blocks: the lock's contents fail.
    with pytest.raises(UsageError, match="cannot write .*run.lock.*No space left on device"):
        RunLock(out).acquire()
    assert os.listdir(out) == []
    (small_disk / "filler").unlink()
    RunLock(out).acquire().release()  # at once: no lock of nobody's to wait out


@pytest.fixture
def checkpoint(tmp_path):
    out = tmp_path / "trained"
    run_script("train.py", [*FAST, "data.train_size=64", "train.epochs=1", f"output_dir={out}"])
    return out / "checkpoints" / "last.pt"


@pytest.mark.parametrize("place", ["under a file", "read-only disk", "full disk"])
def test_export_to_a_place_it_cannot_write_is_one_line(checkpoint, small_disk, place):
    if place == "under a file":
        (small_disk / "a_file").write_text("")
        out, reason = small_disk / "a_file" / "model.pt", f"'{small_disk / 'a_file'}' is a file"
    elif place == "read-only disk":
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        out, reason = small_disk / "model.pt", "Read-only file system"
    else:
        fill(small_disk)
        out, reason = small_disk / "model.pt", "No space left on device"
    result = run_script("export.py", ["--checkpoint", checkpoint, "--out", out], check=False)
    assert one_error_line(result).startswith(f"error: cannot write '{out}': {reason}; choose an --out"), result.stderr
    assert not out.exists() and not [p for p in small_disk.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_at_start_names_the_file_it_could_not_write(small_disk):
    out = small_disk / "run"
    fill(small_disk, leave_pages=1)  # the run lock's
    result = run_script("train.py", [*FAST, f"output_dir={out}"], nproc=2, check=False)
    assert one_error_line(result).startswith(f"error: cannot write '{out / 'config.yaml'}': No space left on device")
    assert not (out / "run.lock").exists()  # released: the same command works once there is room
