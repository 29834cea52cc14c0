"""Shared helpers: run the project's scripts as real processes (python or torchrun)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]

# Small and fast: the mlp model, tiny synthetic data, no worker processes.
FAST = [
    "model.name=mlp",
    "model.hidden_dim=32",
    "data.image_size=8",
    "data.train_size=1024",
    "data.val_size=101",
    "data.num_workers=0",
    "train.batch_size=16",
    "train.lr=0.1",
    "data.augment=false",
    "train.log_every_steps=4",
]


def run_script(script, args, nproc=None, env=None, timeout=240, check=True):
    """Run train.py/evaluate.py in a fresh process (under torchrun when `nproc` is set)."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID"):
        full_env.pop(key, None)
    result = subprocess.run(
        [*launcher, script, *map(str, args)],
        cwd=PROJECT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fast_args():
    return list(FAST)
