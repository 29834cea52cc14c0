"""End to end: real processes, launched as a user would (python and torchrun)."""

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
import yaml

from conftest import (
    FAST,
    REFERENCE_TASK,
    clean_env,
    command,
    has,
    machinery_project,
    read_metrics,
    reference_config,
    run_script,
)
from engine.checkpoint import load_checkpoint

FAST_SHORT = [*FAST, "train.epochs=1", "data.train_size=512"]


def test_two_process_run_trains_evaluates_checkpoints_and_resumes(tmp_path, fast_args):
    out = tmp_path / "run"
    first = run_script("train.py", [*fast_args, f"output_dir={out}", "train.epochs=2"], nproc=2)
    assert "training on 2 process(es)" in first.stdout
    # Not a terminal: plain progress lines, from rank 0 only.
    assert len(re.findall(r"^epoch 0 step 4 loss [\d.]+ lr \S+ samples/s \d+$", first.stdout, re.M)) == 1
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1]
    assert all(m["num_samples"] == 101 for m in metrics)  # every val sample once, none padded
    assert metrics[-1]["val_acc"] > 0.3  # 10 classes: chance is 0.1
    assert {p.name for p in (out / "checkpoints").iterdir()} >= {"last.pt", "best.pt"}
    assert (out / "config.yaml").is_file()

    again = run_script("train.py", [*fast_args, f"output_dir={out}", "train.epochs=3"], nproc=2)
    assert f"resumed from {out / 'checkpoints' / 'last.pt'}: epoch 2" in again.stdout
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1, 2]  # appended, not overwritten
    assert load_checkpoint(out / "checkpoints" / "last.pt")["epoch"] == 3

    evaluated = run_script("evaluate.py", ["--checkpoint", out / "checkpoints" / "last.pt"], nproc=2)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["num_samples"] == 101
    assert abs(result["val_acc"] - metrics[-1]["val_acc"]) < 1e-9
    assert abs(result["val_loss"] - metrics[-1]["val_loss"]) < 1e-6


def test_batchnorm_model_evaluates_what_rank_0_saves(tmp_path, fast_args):
    # Without SyncBatchNorm (CPU) each rank's running statistics drift apart; evaluation
    # must use rank 0's, which are the ones in the checkpoint.
    out = tmp_path / "run"
    args = [*fast_args, "model.name=resnet18", "data.train_size=256", "train.epochs=1", f"output_dir={out}"]
    trained_output = run_script("train.py", args, nproc=2).stdout
    assert trained_output.count("note: SyncBatchNorm needs CUDA GPUs, so it is skipped here") == 1  # rank 0 says it
    evaluated = run_script("evaluate.py", ["--checkpoint", out / "checkpoints" / "last.pt"], nproc=2)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    trained = read_metrics(out)[-1]
    assert result["val_acc"] == trained["val_acc"]
    assert abs(result["val_loss"] - trained["val_loss"]) < 1e-6


def run_with_terminal_stderr(args, timeout=240) -> tuple[str, str]:
    """train.py with stderr on a pseudo-terminal, as in a shell; returns (stdout, terminal)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    with subprocess.Popen(
        command("train.py", args),
        cwd=machinery_project(),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=terminal,
        text=True,
    ) as process:
        os.close(terminal)
        chunks, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not select.select([controller], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        else:
            process.kill()
        stdout = process.stdout.read()
    os.close(controller)
    terminal_text = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 0, stdout + terminal_text
    return stdout, terminal_text


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_single_process_run_on_a_terminal(tmp_path, fast_args):
    out = tmp_path / "run"
    stdout, terminal = run_with_terminal_stderr([*fast_args, f"output_dir={out}", "train.epochs=1"])
    assert [m["num_samples"] for m in read_metrics(out)] == [101]
    # A progress bar with loss and throughput instead of the plain lines.
    assert "epoch 0: " in terminal and "loss=" in terminal and "samples_s=" in terminal
    assert "epoch 0 step" not in stdout and "epoch 0: train_loss" in stdout


def test_bad_config_is_one_line_and_exit_code_2(tmp_path):
    result = run_script("train.py", ["optim.lrr=0.1"], check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"


def test_bad_config_under_torchrun_is_reported_once(tmp_path):
    result = run_script("train.py", ["train.batch_size=0"], nproc=2, check=False, real_launcher=True)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert lines.count("error: train.batch_size must be > 0, got 0") == 1  # from rank 0 alone
    if has("engine/launch.py"):  # the launcher part hands the line to torchrun's summary
        assert "traceback : error: train.batch_size must be > 0, got 0" in [line.strip() for line in lines]


@pytest.mark.parametrize(
    "switches",
    [["train.compile=true", "train.channels_last=true"], ["dist.static_graph=true", "dist.bucket_cap_mb=0.01"]],
)
@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_speed_switches_keep_the_math(tmp_path, switches):
    """torch.compile, channels_last, DDP static_graph and bucket size change speed only."""
    args = [*FAST_SHORT, "checkpoint.resume=none"]
    plain, switched = tmp_path / "plain", tmp_path / "switched"
    run_script("train.py", [*args, f"output_dir={plain}"], nproc=2)
    # torch.compile starts compile workers of its own: a fresh process, as users run it
    # (forked from the rank server, a first compile with a cold cache ran past 240 s).
    compiled = "train.compile=true" in switches
    run_script("train.py", [*args, *switches, f"output_dir={switched}"], nproc=2, real_launcher=compiled)
    a = load_checkpoint(plain / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(switched / "checkpoints" / "last.pt")["model"]
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-4, atol=1e-5, msg=key)


# A bad config stops train.py, a real process, in one line (the checks themselves: test_config.py).


def test_print_config_shows_every_key_with_its_meaning():
    shown = subprocess.run(
        [sys.executable, "train.py", "--print-config", "optim.lr=0.3"],
        cwd=machinery_project(),
        capture_output=True,
        text=True,
    ).stdout
    reparsed = reference_config(None, base=yaml.safe_load(shown))
    assert reparsed == reference_config(REFERENCE_TASK / "config.yaml", ["optim.lr=0.3"])
    assert "lr: 0.3" in shown and "(default 0.2)" in shown
    assert "  best_metric: val_acc" in shown and "(default val_loss)" in shown
    assert "  name: synthetic                        # synthetic (made from the seed) | imagefolder | cifar10" in shown


@pytest.mark.parametrize(
    "config, args, message",
    [
        (None, ["optim.lr=.nan"], "error: optim.lr must be a finite number, got nan"),
        (None, ["optim.lr=0.1", "optim.lr=0.2"], "error: optim.lr is given twice on the command line ('0.1', then"),
        ("train:\n  optimizer: adamw\n", [], "error: config key 'train.optimizer' moved to 'optim.name'; rename it"),
        ("optim:\n  lr: 0.1\n  lr: 0.2\n", [], "error: bad.yaml line 3: key 'lr' is written twice in one section"),
        (b"optim:\n  lr: 0.1 \xff\n", [], "error: config file 'bad.yaml' is not UTF-8 text: byte 0xff at position 17"),
    ],
)
def test_bad_config_stops_train_py_with_one_line(config, args, message):
    project = machinery_project()
    if config is not None:
        path = project / "bad.yaml"
        path.write_bytes(config if isinstance(config, bytes) else config.encode())
        args = ["--config", "bad.yaml", *args]
    run = subprocess.run([sys.executable, "train.py", *args], cwd=project, capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith(message) and run.stderr.count("\n") == 1, run.stderr
