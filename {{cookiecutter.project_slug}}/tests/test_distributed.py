from pathlib import Path

import pytest
import torch

from engine.distributed import (
    DistEnv,
    check_gloo_address,
    expand_nodelist,
    multi_node,
    parse_dist_env,
    process_group_env,
    select_backend,
    select_device,
    slurm_port,
)
from engine.errors import ConfigError, UsageError
from engine.parallel import use_sync_batchnorm


def test_plain_python_is_one_process():
    assert parse_dist_env({}) == DistEnv()
    assert not parse_dist_env({}).distributed


def test_torchrun_variables():
    env = parse_dist_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "torchrun")


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
    assert env.master_port == slurm_port("123456")


def test_the_slurm_port_is_outside_the_kernels_ephemeral_range():
    """Ports the kernel gives outgoing connections may be taken at any time."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {slurm_port(str(job)) for job in range(0, 10**6, 997)}
    assert len(ports) > 900  # jobs sharing a node get different ports
    assert not [port for port in ports if low <= port <= high or port == 29500]


def test_torchrun_inside_slurm_uses_torchrun_variables():
    env = parse_dist_env({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert env.launcher == "torchrun" and env.world_size == 2


def test_python_in_a_batch_script_is_one_process():
    # A batch script sees the job's SLURM_NTASKS but is not an srun step.
    batch = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert parse_dist_env(batch) == DistEnv()


def test_explicit_master_address_wins():
    env = parse_dist_env({**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("a[1-2],b7,c[003,010]", ["a1", "a2", "b7", "c003", "c010"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("host-a,host-b", ["host-a", "host-b"]),
    ],
)
def test_nodelist_forms(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


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
def test_wrap_model_on_gpu_for_one_process():
    from conftest import reference_config
    from engine.parallel import wrap_model
    from model import BLOCKS, small_image_resnet18

    cfg = reference_config(None, [])
    model, train_model = wrap_model(small_image_resnet18(10), cfg, DistEnv(), torch.device("cuda", 0), BLOCKS)
    assert train_model is model
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())


def test_process_group_variables_connect_gloo_lazily_and_record_collectives():
    trace_dir = Path("/runs/a/flight_recorder")
    assert process_group_env({}, 2000, trace_dir) == {
        "TORCH_GLOO_LAZY_INIT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/flight_recorder/rank_",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    # Off, or no place to write to (evaluate.py): only the lazy connections.
    assert process_group_env({}, 0, trace_dir) == {"TORCH_GLOO_LAZY_INIT": "1"}
    assert process_group_env({}, 2000, None) == {"TORCH_GLOO_LAZY_INIT": "1"}


def test_process_group_variables_set_at_launch_win_under_either_name():
    launch = {
        "TORCH_GLOO_LAZY_INIT": "0",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "10",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/",
    }
    assert process_group_env(launch, 2000, Path("/runs/a/fr")) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


@pytest.mark.parametrize(
    "environ, spans_hosts",
    [
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),
        ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "2"}, False),  # this step, not the job
        ({**SRUN_TASK, "SLURM_NNODES": "2"}, True),
        ({}, False),
    ],
)
def test_multi_node_jobs_are_told_from_single_node_ones(environ, spans_hosts):
    assert multi_node(environ) is spans_hosts


def test_a_multi_node_job_on_a_loopback_host_name_is_told_to_set_gloo_socket_ifname():
    with pytest.raises(UsageError, match=r"'localhost' resolves to 127\.0\.0\.1.*set GLOO_SOCKET_IFNAME"):
        check_gloo_address("localhost", True, {})
    check_gloo_address("localhost", False, {})  # one host: loopback reaches every rank
    check_gloo_address("localhost", True, {"GLOO_SOCKET_IFNAME": "lo"})  # the user chose
