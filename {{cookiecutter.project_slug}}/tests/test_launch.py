"""Launch modes: several torchrun 'nodes' on this machine, and node-local preparation."""

import subprocess
import sys

import pytest
import torch

from conftest import FAST, clean_env, free_port, machinery_project, run_script
from engine.checkpoint import load_checkpoint

RUN = [*FAST, "train.epochs=1", "checkpoint.resume=none"]


def torchrun_node(node_rank: int, rendezvous: list[str], args: list, extra_env=None) -> subprocess.Popen:
    """One 'node' of a two-node job: its own torchrun agent with one worker."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--nproc-per-node=1",
            *rendezvous,
            *map(str, args),
        ],
        cwd=machinery_project(),
        env=clean_env(extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_two_nodes(rendezvous, args, extra_env=None):
    nodes = [torchrun_node(rank, rendezvous, args, extra_env) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output
    return outputs


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_nodes_train_like_one_node_with_two_processes(tmp_path, backend):
    port = free_port()
    rendezvous = {
        "static": ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"],
        "c10d": ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test"],
    }[backend]
    one_node, two_nodes = tmp_path / "one", tmp_path / "two"
    run_script("train.py", [*RUN, f"output_dir={one_node}"], nproc=2)
    outputs = run_two_nodes(rendezvous, ["train.py", *RUN, f"output_dir={two_nodes}"])
    assert sum("training on 2 process(es)" in output for output in outputs) == 1  # global rank 0 logs
    a = load_checkpoint(one_node / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(two_nodes / "checkpoints" / "last.pt")["model"]
    for key, value in a.items():
        assert torch.equal(b[key], value), key


NODE_LEADERS = """
import sys, time
import torch.distributed as dist
from engine.config import DistConfig
from engine.distributed import init_distributed_mode, prepare_on_node_leaders

env, device = init_distributed_mode(DistConfig())
log = sys.argv[1]

def prepare(cfg):
    with open(log, "a") as f:
        f.write(f"start {env.rank} {env.local_rank}\\n")
    time.sleep(0.5)  # e.g. a download
    with open(log, "a") as f:
        f.write(f"end {env.rank} {env.local_rank}\\n")

prepare_on_node_leaders(prepare, None, env, device)
with open(log, "a") as f:
    f.write(f"after {env.rank}\\n")
dist.destroy_process_group()
"""


def test_only_the_node_leader_prepares_while_the_others_wait(tmp_path):
    script, log = tmp_path / "prepare.py", tmp_path / "order.log"
    script.write_text(NODE_LEADERS)
    run_script(str(script), [log], nproc=3, env={"PYTHONPATH": str(machinery_project())})
    events = log.read_text().split("\n")[:-1]
    assert events[:2] == ["start 0 0", "end 0 0"]  # the others waited for it
    assert sorted(events[2:]) == ["after 0", "after 1", "after 2"]  # and did not prepare
