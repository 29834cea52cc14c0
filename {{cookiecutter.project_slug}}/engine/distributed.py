"""Process-group setup for `python`, `torchrun` and `srun` launches, and the collectives the loop uses."""

import contextlib
import datetime
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import DistConfig
from engine.errors import ConfigError, PeerFailed, UsageError

SLURM_PORTS = range(12000, 29000)  # below torchrun's 29500 and Linux's ephemeral range (32768-60999)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"  # none | torchrun | slurm
    master_addr: str = ""  # where rank 0 serves the store
    master_port: int = 0
    by_hand: bool = False  # RANK etc. set without torchrun's agent: e.g. left in a shell


def parse_dist_env(environ: Mapping[str, str]) -> DistEnv:
    """torchrun's variables, else an srun task's, else one process; a malformed one is a UsageError naming it."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return torchrun_env(environ)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:  # not set for `python train.py` in a batch job
        return srun_env(environ)
    return DistEnv()


def torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    fix = "unset it to run one process, or start with torchrun/srun, which set it"
    rank, world_size, local_rank = (whole_number(environ, name, fix) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    for name, partner in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if name not in environ:
            fix = f"set both (torchrun/srun do), or unset {partner} to run one process"
            raise UsageError(f"{name} is not set, but {partner} is {environ[partner]!r}: {fix}")
    one_process = "unset RANK and WORLD_SIZE to run one process"
    check_rank("RANK", rank, "WORLD_SIZE", world_size, f"{one_process}, or start with torchrun/srun, which set them")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise UsageError(
                f"{name} is not set, but RANK and WORLD_SIZE are: set MASTER_ADDR and MASTER_PORT to rank 0's host "
                f"and a free port there, {one_process}, or start with torchrun, which sets them all"
            )
    port = port_number(environ, f"set it to a free port of rank 0's host, or {one_process}")
    by_hand = "TORCHELASTIC_RUN_ID" not in environ  # torchrun's agent sets it for every process
    return DistEnv(rank, world_size, local_rank or 0, "torchrun", environ["MASTER_ADDR"], port, by_hand)


def srun_env(environ: Mapping[str, str]) -> DistEnv:
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    fix = "srun sets it for each task; unset it and SLURM_STEP_ID to run one process, or start with srun"
    rank, world_size, local_rank = (whole_number(environ, n, fix) for n in ("SLURM_PROCID", tasks, "SLURM_LOCALID"))
    world_size = 1 if world_size is None else world_size
    fix = "srun sets them for each task; unset SLURM_PROCID and SLURM_STEP_ID to run one process, or start with srun"
    check_rank("SLURM_PROCID", rank, tasks, world_size, fix)
    if environ.get("MASTER_PORT"):
        port = port_number(environ, "set it to a free port of the first host, or unset it to use the job's")
    else:
        fix = "set MASTER_PORT to a free port of the first host, or start with srun, which sets it"
        port = slurm_port(whole_number(environ, "SLURM_JOB_ID", fix) or 0)
    # The master: the node list's first host, e.g. 'gpu[07-09,12],cpu5' -> 'gpu07' (each bracket's first number).
    nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
    first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodelist).group()  # up to a comma outside brackets
    host = environ.get("MASTER_ADDR") or re.sub(r"\[(\d*)[^\]]*\]", r"\1", first).strip() or "127.0.0.1"
    return DistEnv(rank, world_size, local_rank or 0, "slurm", host, port)


def whole_number(environ: Mapping[str, str], name: str, fix: str) -> int | None:
    value = environ.get(name)
    if value is not None and not (value.strip().isascii() and value.strip().isdigit()):
        raise UsageError(f"{name} is {value!r}, not a whole number: {fix}")
    return None if value is None else int(value)


def check_rank(rank_name: str, rank: int, world_name: str, world_size: int, fix: str) -> None:
    if world_size < 1:
        raise UsageError(f"{world_name} is '{world_size}', not a number of processes (1 or more): {fix}")
    if rank >= world_size:
        processes = f"{world_name}={world_size} processes (0 to {world_size - 1})"
        raise UsageError(f"{rank_name} is '{rank}', not a rank of {processes}: {fix}")


def port_number(environ: Mapping[str, str], fix: str) -> int:
    port = whole_number(environ, "MASTER_PORT", fix)
    if not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT is {environ['MASTER_PORT']!r}, not a port (1 to 65535): {fix}")
    return port


def waiting_notice(env: DistEnv, timeout_minutes: float) -> str:
    """What a rank started by hand says before it waits: RANK etc. left in a shell would wait in silence."""
    if not env.by_hand or env.world_size == 1:
        return ""
    return (
        f"rank {env.rank} of {env.world_size}: waiting up to {timeout_minutes:g} min (dist.timeout_minutes) for the "
        f"other processes at {env.master_addr}:{env.master_port}, as RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
        "in the environment ask; unset them to run one process"
    )


def slurm_port(job_id: int) -> int:
    """From the job id, so two jobs sharing a node do not collide."""
    return SLURM_PORTS.start + job_id % len(SLURM_PORTS)


def select_backend(requested: str, cuda_available: bool) -> str:
    """NCCL for GPU tensors beside gloo for the few CPU tensors that travel; gloo alone without GPUs."""
    if requested == "nccl" and not cuda_available:
        raise ConfigError("dist.backend=nccl needs CUDA GPUs; use dist.backend=gloo or auto")
    return ("cpu:gloo,cuda:nccl" if cuda_available else "gloo") if requested == "auto" else requested


def select_device(env: DistEnv, cuda_available: bool, device_count: int = 0) -> torch.device:
    """The GPU of this local rank; the one GPU the launcher shows (--gpus-per-task=1); else the CPU."""
    if not cuda_available:
        return torch.device("cpu")
    if device_count > 1 and env.local_rank >= device_count:
        fix = "start one process per GPU: --nproc_per_node / --ntasks-per-node"
        raise UsageError(f"local rank {env.local_rank} has no GPU: {device_count} visible ({fix})")
    return torch.device("cuda", env.local_rank if device_count > 1 else 0)


def init_distributed_mode(cfg: DistConfig, parts=()) -> tuple[DistEnv, torch.device]:
    """Bind this process to its device, then join the process group (if launched); `parts` may set its variables."""
    env = parse_dist_env(os.environ)
    cuda = torch.cuda.is_available()
    device = select_device(env, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any other CUDA call, so nothing lands on GPU 0
    if env.launcher != "none":
        wanted = {name: value for part in parts for name, value in (part.process_group_env(env) or {}).items()}
        os.environ.update(process_group_env(os.environ, wanted))
        if notice := waiting_notice(env, cfg.timeout_minutes):
            print(notice, file=sys.stderr, flush=True)
        meet = f"tcp://{env.master_addr}:{env.master_port}" if env.launcher == "slurm" else "env://"
        timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
        backend, device_id = select_backend(cfg.backend, cuda), device if device.type == "cuda" else None
        dist.init_process_group(backend, meet, timeout, world_size=env.world_size, rank=env.rank, device_id=device_id)
    return env, device


def process_group_env(environ: Mapping[str, str], wanted: Mapping[str, str] | None = None) -> dict[str, str]:
    """`wanted` and TORCH_GLOO_LAZY_INIT (at 1,000 ranks tens of sockets a process, not ~2,000),
    but those set at launch: they win."""
    wanted = {"TORCH_GLOO_LAZY_INIT": "1", **(wanted or {})}
    return {name: value for name, value in wanted.items() if name not in environ}


def shorten_timeout_after_first_step(optimizer: torch.optim.Optimizer, minutes: float, groups=()) -> None:
    """After the first step, a collective waiting over `minutes` fails: setup may take long, a step should not."""
    if get_world_size() == 1:
        return
    pending = [None, *groups]

    def shorten(*_) -> None:
        while pending:  # once; the hook stays (the optimizer is iterating over its hooks)
            dist.set_timeout(datetime.timedelta(minutes=minutes), group=pending.pop())

    optimizer.register_step_post_hook(shorten)


def lost_peer(error: BaseException | None) -> bool:
    gloo = r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe"  # gloo says so in a plain RuntimeError
    network = isinstance(error, (dist.DistNetworkError, dist.DistStoreError))
    return network or (isinstance(error, RuntimeError) and re.search(gloo, str(error)) is not None)


def cleanup_distributed(parts=()) -> None:
    """Ranks leaving together first meet (a lazy gloo connection to a closed peer aborts at exit); one alone never
    waits. After a lost peer, `parts` may first write what they know (e.g. the flight recorder)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    error = sys.exc_info()[1]
    if error is None or getattr(error, "agreed", False):
        with contextlib.suppress(RuntimeError):  # a peer gone meanwhile: leave anyway
            dist.barrier()  # on the device bound at init (device_id): never a guess at GPU 0
    elif lost_peer(error):
        for part in parts:
            part.lost_peer(error)
    dist.destroy_process_group()


def get_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    with contextlib.suppress(UsageError):  # a malformed launch: each process reports it, no rank 0 to leave it to
        return parse_dist_env(os.environ).rank  # os.environ itself: copying it took ~30 us of a small step
    return 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    return get_rank() == 0


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """`tensor` reduced ("sum", "min" or "max") over `group` (None: all processes), in place; all must call."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return tensor


def vote(values: list[float], op: str, group=None, device: torch.device | None = None) -> list[float]:
    """Each of `values` reduced ("min" or "max") over `group` (None: the default, on `device`); all must call."""
    if get_world_size() == 1:
        return values  # no device call: the failure voted on may be the device's own
    return all_reduce(torch.tensor(values, dtype=torch.float64, device=device), op, group).tolist()


@contextlib.contextmanager
def stop_all_if_any_fails(device: torch.device):
    """Around work that may fail on some ranks only: if it fails on any, all stop, the lowest failing rank says why."""
    error = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001  every rank must reach the vote below
        error = caught
    rank, world = get_rank(), get_world_size()
    failed_rank = int(vote([rank if error is not None else world], "min", device=device)[0])
    if failed_rank == world:
        return
    if error is None or failed_rank != rank:
        raise agreed(PeerFailed(f"rank {failed_rank} failed"))
    if isinstance(error, OSError):
        where = f" {error.filename!r}" if error.filename else ""
        error = UsageError(f"cannot access{where}: {error.strerror or error}")
    error.local = True  # raised on this rank only: report it here, even if not rank 0
    raise agreed(error)


def agreed(error: BaseException) -> BaseException:
    """Mark an error every rank raises together, so they can leave together."""
    error.agreed = True
    return error


def prepare_on_node_leaders(prepare, cfg, env: DistEnv, device: torch.device) -> None:
    """`prepare(cfg)` on rank 0, then on the other nodes' local rank 0: never two writers on shared storage."""
    for leaders_now in (env.rank == 0, env.local_rank == 0 and env.rank != 0):
        with stop_all_if_any_fails(device):
            if leaders_now:
                prepare(cfg)


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (e.g. BatchNorm statistics) on every rank, so all evaluate the model rank 0 saves."""
    if get_world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order; every rank must call this."""
    gathered = [obj] * get_world_size()
    if len(gathered) > 1:
        dist.all_gather_object(gathered, obj)
    return gathered


def gather_objects_on_main(obj) -> list | None:
    """Every rank's `obj` in rank order on rank 0, None elsewhere; every rank must call this."""
    gathered = [obj] * get_world_size() if is_main() else None
    if get_world_size() > 1:
        dist.gather_object(obj, gathered, dst=0)
    return gathered


def broadcast_from_main(obj):
    """Rank 0's `obj` on every rank; every rank must call this."""
    box = [obj]
    if get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
