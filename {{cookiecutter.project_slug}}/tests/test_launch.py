"""Launch modes: several torchrun 'nodes' on this machine, and node-local preparation."""

import subprocess
import sys

import pytest
import torch

from conftest import FAST, clean_env, forkable, free_port, has, machinery_project, run_script
from engine.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # every launcher's environment, real processes: the slow tier (pytest -m slow)

RUN = [*FAST, "train.epochs=1", "checkpoint.resume=none"]


# Both "nodes" are this host, whose name resolves to a loopback address: gloo must be
# told to use it, as on a real cluster it is told which interface reaches the other nodes.
ONE_HOST = {"GLOO_SOCKET_IFNAME": "lo"}


def torchrun_node(node_rank: int, rendezvous: list[str], args: list, extra_env=ONE_HOST) -> subprocess.Popen:
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


def run_two_nodes(rendezvous, args, extra_env=ONE_HOST, expect=0):
    nodes = [torchrun_node(rank, rendezvous, args, extra_env) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == expect, output
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


@pytest.mark.skipif(not has("engine/parts/run_record.py"), reason="the run_record part checks gloo's address")
def test_a_multi_node_job_on_a_host_name_others_cannot_reach_stops_in_one_line(tmp_path):
    # Without GLOO_SOCKET_IFNAME, gloo would listen on the address of this host's name
    # (127.0.0.1 here): unreachable from a real second node.
    port = free_port()
    rendezvous = ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"]
    outputs = run_two_nodes(rendezvous, ["train.py", *RUN, f"output_dir={tmp_path}"], extra_env=None, expect=1)
    errors = [line for output in outputs for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, outputs
    assert "resolves to 127." in errors[0] and "set GLOO_SOCKET_IFNAME" in errors[0]
    assert not (tmp_path / "checkpoints").exists()


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


def test_runs_are_forked_unless_their_environment_needs_a_new_process():
    """The tests' runs fork from the rank server (pytest's own per-test variable aside);
    settings a process reads at start get a fresh one."""
    later_test = clean_env({"PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"})
    assert forkable(later_test) and forkable(clean_env({"PYTHONPATH": "/x", "WANDB_MODE": "offline"}))
    assert not forkable(clean_env({"MALLOC_ARENA_MAX": "2"})) and not forkable(clean_env({"TORCH_LOGS": "+dynamo"}))
