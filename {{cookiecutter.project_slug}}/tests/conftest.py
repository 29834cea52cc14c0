"""Shared helpers: run the project's scripts as real processes (python or torchrun)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data import DataConfig
from engine.config import load_config
from model import ModelConfig

PROJECT = Path(__file__).resolve().parents[1]

# Small and fast: the mlp model, tiny synthetic data, no worker processes.
FAST = [
    "model.name=mlp",
    "model.hidden_dim=32",
    "data.image_size=8",
    "data.train_size=1024",
    "data.val_size=101",
    "train.num_workers=0",
    "train.batch_size=16",
    "train.lr=0.1",
    "data.augment=false",
    "train.log_every_steps=4",
]


def project_config(path=None, overrides=(), base=None):
    """This project's config: config.yaml's schema with the example task's sections."""
    return load_config(path, list(overrides), data=DataConfig, model=ModelConfig, base=base)


def command(script, args, nproc=None, torchrun_args=()):
    """The command line for a script, under torchrun when `nproc` is set."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    return [*launcher, script, *map(str, args)]


def clean_env(extra=None) -> dict:
    """This environment without launcher variables (the tests may run under torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_ID"):
        env.pop(key, None)
    return {**env, **(extra or {})}


def run_script(script, args, nproc=None, env=None, timeout=240, check=True, torchrun_args=(), cwd=PROJECT):
    """Run train.py/evaluate.py in a fresh process (under torchrun when `nproc` is set)."""
    result = subprocess.run(
        command(script, args, nproc, torchrun_args),
        cwd=cwd,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def start_script(script, args, nproc=None, env=None, torchrun_args=()) -> subprocess.Popen:
    """Start a script in the background, its output (stderr merged) readable line by line."""
    return subprocess.Popen(
        command(script, args, nproc, torchrun_args),
        cwd=PROJECT,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


def wait_for_line(process: subprocess.Popen, needle: str, seen: list, timeout=120) -> str:
    """Read the process's output until a line contains `needle`; keeps all lines in `seen`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"exited before {needle!r}:\n{''.join(seen)}")
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} within {timeout} s:\n{''.join(seen)}")


def finish(process: subprocess.Popen, seen: list, timeout=120) -> str:
    """Wait for the process to end; returns its whole output."""
    rest, _ = process.communicate(timeout=timeout)
    seen.append(rest)
    return "".join(seen)


def free_port() -> int:
    """A TCP port nobody listens on right now, for a rendezvous on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (torchrun's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fast_args():
    return list(FAST)
