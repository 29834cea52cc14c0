import signal
import threading
from pathlib import Path

import pytest
import torch

from conftest import FAST, free_port, run_script, start_script, wait_for_line
from engine.distributed import (
    DistEnv,
    parse_dist_env,
    process_group_env,
    select_backend,
    select_device,
    slurm_port,
    waiting_notice,
)
from engine.errors import ConfigError, UsageError
from engine.parallel import use_sync_batchnorm


def test_plain_python_is_one_process():
    assert parse_dist_env({}) == DistEnv()
    assert parse_dist_env({}).launcher == "none"


# What torchrun gives a process (among others): its rank, and where rank 0 serves the store.
TORCHRUN_RANK = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node-0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "myjob",
}


def test_torchrun_variables():
    env = parse_dist_env(TORCHRUN_RANK)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "torchrun")
    assert (env.master_addr, env.master_port) == ("node-0", 29500)


SRUN_TASK = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_srun_task():
    env = parse_dist_env(SRUN_TASK)
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert env.launcher == "slurm" and env.master_addr == "gpu07"
    assert env.master_port == slurm_port(123456)


def test_the_slurm_port_is_outside_the_kernels_ephemeral_range():
    """Ports the kernel gives outgoing connections may be taken at any time."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {slurm_port(job) for job in range(0, 10**6, 997)}
    assert len(ports) > 900  # jobs sharing a node get different ports
    assert not [port for port in ports if low <= port <= high or port == 29500]


def test_torchrun_inside_slurm_uses_torchrun_variables():
    env = parse_dist_env({**SRUN_TASK, **TORCHRUN_RANK, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert env.launcher == "torchrun" and env.world_size == 2


def test_python_in_a_batch_script_is_one_process():
    # A batch script sees the job's SLURM_NTASKS but is not an srun step.
    batch = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert parse_dist_env(batch) == DistEnv()


def test_explicit_master_address_wins():
    env = parse_dist_env({**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


NOT_TORCHRUN = "unset it to run one process, or start with torchrun/srun, which set it"
NOT_SRUN = "srun sets it for each task; unset it and SLURM_STEP_ID to run one process, or start with srun"
BY_HAND = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "environ, message",
    [
        ({**BY_HAND, "RANK": "abc"}, f"RANK is 'abc', not a whole number: {NOT_TORCHRUN}"),
        ({"RANK": "abc"}, f"RANK is 'abc', not a whole number: {NOT_TORCHRUN}"),
        ({**BY_HAND, "RANK": "-1"}, f"RANK is '-1', not a whole number: {NOT_TORCHRUN}"),
        ({**BY_HAND, "WORLD_SIZE": "two"}, f"WORLD_SIZE is 'two', not a whole number: {NOT_TORCHRUN}"),
        ({**BY_HAND, "LOCAL_RANK": "1.0"}, f"LOCAL_RANK is '1.0', not a whole number: {NOT_TORCHRUN}"),
        ({**BY_HAND, "WORLD_SIZE": "0"}, "WORLD_SIZE is '0', not a number of processes (1 or more): unset RANK and"),
        ({**BY_HAND, "RANK": "5"}, "RANK is '5', not a rank of WORLD_SIZE=2 processes (0 to 1): unset RANK and"),
        ({"RANK": "1"}, "WORLD_SIZE is not set, but RANK is '1': set both (torchrun/srun do), or unset RANK to"),
        ({"WORLD_SIZE": "2"}, "RANK is not set, but WORLD_SIZE is '2': set both (torchrun/srun do), or unset"),
        ({**BY_HAND, "MASTER_ADDR": ""}, "MASTER_ADDR is not set, but RANK and WORLD_SIZE are: set MASTER_ADDR"),
        ({"RANK": "5", "WORLD_SIZE": "8"}, "MASTER_ADDR is not set, but RANK and WORLD_SIZE are: set MASTER_ADDR"),
        ({**BY_HAND, "MASTER_PORT": "abc"}, "MASTER_PORT is 'abc', not a whole number: set it to a free port"),
        ({**BY_HAND, "MASTER_PORT": "70000"}, "MASTER_PORT is '70000', not a port (1 to 65535): set it to a free"),
        ({**BY_HAND, "MASTER_PORT": "0"}, "MASTER_PORT is '0', not a port (1 to 65535): set it to a free port"),
        ({k: v for k, v in BY_HAND.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set, but RANK and"),
        ({**SRUN_TASK, "SLURM_PROCID": "abc"}, f"SLURM_PROCID is 'abc', not a whole number: {NOT_SRUN}"),
        ({**SRUN_TASK, "SLURM_NTASKS": "x"}, f"SLURM_NTASKS is 'x', not a whole number: {NOT_SRUN}"),
        ({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS is '0', not a number of processes"),
        ({**SRUN_TASK, "SLURM_LOCALID": ""}, f"SLURM_LOCALID is '', not a whole number: {NOT_SRUN}"),
        ({**SRUN_TASK, "SLURM_PROCID": "4"}, "SLURM_PROCID is '4', not a rank of SLURM_NTASKS=4 processes (0 to 3)"),
        ({**SRUN_TASK, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID is 'abc', not a whole number: set MASTER_PORT to a free"),
        ({**SRUN_TASK, "MASTER_PORT": "65536"}, "MASTER_PORT is '65536', not a port (1 to 65535): set it to a free"),
    ],
)
def test_a_malformed_launch_environment_is_one_line_naming_the_variable_and_the_fix(environ, message):
    with pytest.raises(UsageError) as raised:
        parse_dist_env(environ)
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, f"error: RANK is 'abc', not a whole number: {NOT_TORCHRUN}"),
        ({**SRUN_TASK, "SLURM_JOB_ID": "abc"}, "error: SLURM_JOB_ID is 'abc', not a whole number: set MASTER_PORT"),
    ],
    ids=["rank", "slurm-job-id"],
)
def test_train_py_in_a_malformed_launch_environment_stops_with_one_line(tmp_path, environ, message):
    result = run_script("train.py", [*FAST, f"output_dir={tmp_path / 'run'}"], env=environ, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith(message), result.stderr


def test_a_rank_started_by_hand_says_at_once_that_it_waits_and_why(tmp_path):
    """RANK, WORLD_SIZE, MASTER_* left in a shell: `python train.py` must not wait in silence."""
    port = free_port()  # nobody serves it: rank 1 waits for a rank 0 that never comes
    environ = {**BY_HAND, "MASTER_PORT": str(port)}
    process, seen = start_script("train.py", [*FAST, f"output_dir={tmp_path / 'run'}"], env=environ), []
    silence = threading.Timer(60, process.kill)  # a rank that says nothing would block the read for 30 min
    silence.start()
    try:
        line = wait_for_line(process, "waiting", seen)
        assert process.poll() is None  # said while it waits
    finally:
        silence.cancel()
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert line.strip() == (
        f"rank 1 of 2: waiting up to 30 min (dist.timeout_minutes) for the other processes at 127.0.0.1:{port}, "
        "as RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment ask; unset them to run one process"
    )


def test_ranks_that_torchrun_or_srun_started_wait_without_a_word():
    """Their launcher starts every rank at once: a line per rank would be noise."""
    assert waiting_notice(parse_dist_env(TORCHRUN_RANK), 30) == ""
    assert waiting_notice(parse_dist_env(SRUN_TASK), 30) == ""
    assert waiting_notice(parse_dist_env({**BY_HAND, "WORLD_SIZE": "1", "RANK": "0"}), 30) == ""  # nobody to wait for
    assert waiting_notice(parse_dist_env(BY_HAND), 0.5).startswith("rank 1 of 2: waiting up to 0.5 min ")


@pytest.mark.parametrize(
    "nodelist, master",
    [
        ("node01", "node01"),
        ("node[01-04,07]", "node01"),
        ("gpu[9-11]", "gpu9"),
        ("a[1-2],b7,c[003,010]", "a1"),
        ("c[003,010],a[1-2]", "c003"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("host-a,host-b", "host-a"),
        ("", "127.0.0.1"),
    ],
)
def test_an_srun_task_meets_at_the_first_host_of_the_node_list(nodelist, master):
    assert parse_dist_env({**SRUN_TASK, "SLURM_JOB_NODELIST": nodelist}).master_addr == master
    step = {**SRUN_TASK, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": "other[1-9]"}
    assert parse_dist_env(step).master_addr == master  # this step's nodes, not the job's


def test_backend_and_device_selection():
    assert select_backend("auto", cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert select_backend("auto", cuda_available=False) == "gloo"
    assert select_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        select_backend("nccl", cuda_available=False)
    env = DistEnv(rank=5, world_size=8, local_rank=1, launcher="torchrun")
    assert select_device(env, cuda_available=True, device_count=4) == torch.device("cuda", 1)
    assert select_device(env, cuda_available=True, device_count=1) == torch.device("cuda", 0)  # one GPU per task
    assert select_device(env, cuda_available=False) == torch.device("cpu")
    with pytest.raises(UsageError, match="local rank 3 has no GPU: 2 visible"):
        select_device(DistEnv(local_rank=3, world_size=4, launcher="torchrun"), cuda_available=True, device_count=2)


def test_sync_batchnorm_only_on_several_gpus():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_sync_batchnorm(True, cuda, world_size=2)
    assert not use_sync_batchnorm(True, cuda, world_size=1)
    assert not use_sync_batchnorm(True, cpu, world_size=2)
    assert not use_sync_batchnorm(False, cuda, world_size=2)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_build_and_wrap_on_gpu_for_one_process():
    from conftest import reference_config
    from engine.parallel import build_and_wrap
    from model import BLOCKS, small_image_resnet18

    cfg = reference_config(None, [])
    model, train_model = build_and_wrap(
        lambda: small_image_resnet18(10), cfg, DistEnv(), torch.device("cuda", 0), BLOCKS
    )
    assert train_model is model
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def test_process_group_variables_connect_gloo_lazily():
    assert process_group_env({}) == {"TORCH_GLOO_LAZY_INIT": "1"}
    assert process_group_env({"TORCH_GLOO_LAZY_INIT": "0"}) == {}  # set at launch: it wins
