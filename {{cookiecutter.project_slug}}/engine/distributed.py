"""Process-group setup for every way of launching, and the few collectives the loop uses.

One `init_distributed_mode` covers:
  python train.py                   one process, no process group
  torchrun ... train.py             RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from torchrun
  srun python train.py              SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, master from
                                    SLURM_JOB_NODELIST (no scontrol needed)
The variables are checked before any process waits for another: a malformed one stops it
with one line naming the variable.
The state lives in torch.distributed itself; this module keeps none of its own.
"""

import contextlib
import datetime
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
{% if cookiecutter.run_record %}from pathlib import Path
{% endif %}
import torch
import torch.distributed as dist

from engine.config import DistConfig
from engine.errors import ConfigError, PeerFailed, UsageError


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job, read from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"  # none | torchrun | slurm
    master_addr: str = ""  # where rank 0 serves the store
    master_port: int = 0
    by_hand: bool = False  # RANK etc. set without torchrun's agent: e.g. left in a shell

    @property
    def distributed(self) -> bool:
        return self.launcher != "none"


def parse_dist_env(environ: Mapping[str, str]) -> DistEnv:
    """The DistEnv for an environment: torchrun's variables win over SLURM's. A malformed
    one (a rank that is no number or outside the world, no address to meet at) is a
    UsageError naming the variable, before any process waits for another."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return torchrun_env(environ)
    # SLURM_STEP_ID is set by srun only: a plain `python train.py` in a batch script
    # (which also sees SLURM_NTASKS) must stay a single process, not wait for peers.
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return srun_env(environ)
    return DistEnv()


TORCHRUN_FIX = "unset it to run one process, or start with torchrun/srun, which set it"
SRUN_FIX = "srun sets it for each task; unset it and SLURM_STEP_ID to run one process, or start with srun"


def torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* as torchrun sets them (or a user by hand)."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    rank, world_size, local_rank = (whole_number(environ, name, TORCHRUN_FIX) for name in names)
    for name, partner in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if name not in environ:
            raise UsageError(
                f"{name} is not set, but {partner} is {environ[partner]!r}: set both (torchrun/srun do), "
                f"or unset {partner} to run one process"
            )
    one_process = "unset RANK and WORLD_SIZE to run one process"
    launched = f"{one_process}, or start with torchrun/srun, which set them"
    check_rank(("RANK", rank), ("WORLD_SIZE", world_size), launched)
    meeting_fix = (
        f"set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port there, {one_process}, or start with "
        "torchrun, which sets them all"
    )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise UsageError(f"{name} is not set, but RANK and WORLD_SIZE are: {meeting_fix}")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank or 0,
        launcher="torchrun",
        master_addr=environ["MASTER_ADDR"],
        master_port=port_number(environ, f"set it to a free port of rank 0's host, or {one_process}"),
        by_hand="TORCHELASTIC_RUN_ID" not in environ,  # torchrun's agent sets it for every process
    )


def srun_env(environ: Mapping[str, str]) -> DistEnv:
    """An srun task: SLURM_PROCID and the step's task count, the master from the node list."""
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    names = ("SLURM_PROCID", tasks, "SLURM_LOCALID")
    rank, world_size, local_rank = (whole_number(environ, name, SRUN_FIX) for name in names)
    world_size = 1 if world_size is None else world_size
    fix = "srun sets them for each task; unset SLURM_PROCID and SLURM_STEP_ID to run one process, or start with srun"
    check_rank(("SLURM_PROCID", rank), (tasks, world_size), fix)
    nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
    if environ.get("MASTER_PORT"):
        port = port_number(environ, "set it to a free port of the first host, or unset it to use the job's")
    else:
        job_fix = "set MASTER_PORT to a free port of the first host, or start with srun, which sets it"
        port = slurm_port(whole_number(environ, "SLURM_JOB_ID", job_fix) or 0)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank or 0,
        launcher="slurm",
        master_addr=environ.get("MASTER_ADDR") or first_host(nodelist) or "127.0.0.1",
        master_port=port,
    )


def whole_number(environ: Mapping[str, str], name: str, fix: str) -> int | None:
    """The variable's value as a whole number (0, 1, ...); None when unset."""
    value = environ.get(name)
    if value is None:
        return None
    if not (value.strip().isascii() and value.strip().isdigit()):
        raise UsageError(f"{name} is {value!r}, not a whole number: {fix}")
    return int(value)


def check_rank(rank: tuple[str, int], world_size: tuple[str, int], fix: str) -> None:
    """A world of one process or more, and a rank inside it; each as (variable, value)."""
    (rank_name, rank_value), (world_name, world_value) = rank, world_size
    if world_value < 1:
        raise UsageError(f"{world_name} is '{world_value}', not a number of processes (1 or more): {fix}")
    if rank_value >= world_value:
        raise UsageError(
            f"{rank_name} is '{rank_value}', not a rank of {world_name}={world_value} processes "
            f"(0 to {world_value - 1}): {fix}"
        )


def port_number(environ: Mapping[str, str], fix: str) -> int:
    port = whole_number(environ, "MASTER_PORT", fix)
    if not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT is {environ['MASTER_PORT']!r}, not a port (1 to 65535): {fix}")
    return port


def waiting_notice(env: DistEnv, timeout_minutes: float) -> str:
    """What a rank started by hand says before it waits for the others ("" when it need
    not): RANK and the rest left in a shell would otherwise keep `python train.py` waiting,
    silent, for dist.timeout_minutes. torchrun and srun start every rank at once, so their
    ranks say nothing (a line from each would be noise)."""
    if not env.by_hand or env.world_size == 1:
        return ""
    return (
        f"rank {env.rank} of {env.world_size}: waiting up to {timeout_minutes:g} min (dist.timeout_minutes) for the "
        f"other processes at {env.master_addr}:{env.master_port}, as RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
        "in the environment ask; unset them to run one process"
    )


# Below Linux's ephemeral range (32768-60999 by default), from which the kernel hands out
# the local ports of outgoing connections: one of those could already hold the port. And
# below torchrun's default 29500.
SLURM_PORTS = range(12000, 29000)


def slurm_port(job_id: int) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide."""
    return SLURM_PORTS.start + job_id % len(SLURM_PORTS)


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names from SLURM's compressed form, e.g. 'gpu[01-03,07],cpu5' -> 5 names."""
    hosts = []
    # Split on commas that are outside brackets.
    for piece in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts += expand_host_pattern(piece.strip())
    return [h for h in hosts if h]


def expand_host_pattern(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    names = []
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        numbers = range(int(low), int(high or low) + 1)
        names += [f"{head}{n:0{len(low)}d}" for n in numbers]
    # The tail may hold further bracket groups (e.g. rack[1-2]-node[01-02]).
    return [name + rest for name in names for rest in expand_host_pattern(tail)]


def first_host(nodelist: str) -> str:
    hosts = expand_nodelist(nodelist)
    return hosts[0] if hosts else ""


def select_backend(requested: str, cuda_available: bool) -> str:
    """NCCL for GPU tensors, with gloo beside it for the few CPU tensors that travel;
    gloo alone without GPUs."""
    if requested == "nccl" and not cuda_available:
        raise ConfigError("dist.backend=nccl needs CUDA GPUs; use dist.backend=gloo or auto")
    if requested == "auto":
        return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"
    return requested


def select_device(env: DistEnv, cuda_available: bool, device_count: int = 0) -> torch.device:
    """One GPU per process, chosen by local rank; the CPU when there is no GPU. Where the
    launcher shows each process a single GPU (e.g. SLURM --gpus-per-task=1), that one."""
    if not cuda_available:
        return torch.device("cpu")
    if device_count == 1:
        return torch.device("cuda", 0)
    if env.local_rank >= device_count:
        raise UsageError(
            f"local rank {env.local_rank} has no GPU: {device_count} visible "
            "(start one process per GPU: --nproc_per_node / --ntasks-per-node)"
        )
    return torch.device("cuda", env.local_rank)


def init_distributed_mode(cfg: DistConfig{{ ', trace_dir: Path | None = None' if cookiecutter.run_record }}) -> tuple[DistEnv, torch.device]:
    """Bind this process to its device, then join the process group (if launched).{% if cookiecutter.run_record %}
    `trace_dir`: where each rank's flight recorder goes when a collective fails.{% endif %}"""
    env = parse_dist_env(os.environ)
    cuda = torch.cuda.is_available()
    device = select_device(env, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        # Before any other CUDA call, so nothing lands on GPU 0 by default.
        torch.cuda.set_device(device)
    if env.distributed:
        check_gloo_address(socket.gethostname(), multi_node(os.environ), os.environ)
        os.environ.update(process_group_env(os.environ{{ ', cfg.flight_recorder_entries, trace_dir' if cookiecutter.run_record }}))
        if notice := waiting_notice(env, cfg.timeout_minutes):
            print(notice, file=sys.stderr, flush=True)
{%- if cookiecutter.run_record %}
        if trace_dir is not None:  # NCCL's watchdog writes there, but does not make the folder
            with contextlib.suppress(OSError):  # an unwritable output_dir is reported after the lock
                trace_dir.mkdir(parents=True, exist_ok=True)
{%- endif %}
        dist.init_process_group(
            backend=select_backend(cfg.backend, cuda),
            init_method=init_method(env),
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=cfg.timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
    return env, device
{%- if cookiecutter.run_record %}


TRACE_FILE_PREFIX = "rank_"
# The flight recorder's variables under the names older PyTorch releases read.
OLDER_NAMES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}
{%- endif %}


def process_group_env(environ: Mapping[str, str]{{ ', trace_entries: int, trace_dir: Path | None' if cookiecutter.run_record }}) -> dict[str, str]:
    """Variables PyTorch reads when the process groups start; those set at launch win.

    TORCH_GLOO_LAZY_INIT: gloo connects a pair of ranks when a collective first needs it,
    not every pair at start. GPU jobs still use gloo (the stop vote, object collectives),
    on purpose: over NCCL, every vote would wait for the GPU's queue to drain. The votes'
    all-reduce reaches a few peers (3 of 9 measured), so at 1,000 ranks a process holds
    tens of sockets instead of ~2,000.
{%- if cookiecutter.run_record %}
    TORCH_FR_*: the flight recorder. Each rank keeps its last `trace_entries` collectives
    (which, on which group, sizes, state) and writes them to `trace_dir`/rank_N when one
    times out: NCCL's watchdog does, and `dump_flight_recorder` for gloo. Read them with
    `python -m torch.distributed.flight_recorder.fr_trace trace_dir`.
{%- endif %}
    """
    wanted = {"TORCH_GLOO_LAZY_INIT": "1"}
{%- if cookiecutter.run_record %}
    if trace_entries > 0 and trace_dir is not None:
        wanted |= {
            "TORCH_FR_BUFFER_SIZE": str(trace_entries),
            "TORCH_FR_DUMP_TEMP_FILE": f"{trace_dir}/{TRACE_FILE_PREFIX}",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        }
{%- endif %}
    set_at_launch = {name for name in wanted if name in environ}
{%- if cookiecutter.run_record %}
    set_at_launch |= {new for new, old in OLDER_NAMES.items() if old in environ}
{%- endif %}
    return {name: value for name, value in wanted.items() if name not in set_at_launch}


def multi_node(environ: Mapping[str, str]) -> bool:
    """Whether the job spans hosts: torchrun's local world is smaller than the world, or
    SLURM's step has more than one node."""
    if "LOCAL_WORLD_SIZE" in environ and "WORLD_SIZE" in environ:
        return int(environ["LOCAL_WORLD_SIZE"]) < int(environ["WORLD_SIZE"])
    return int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", 1))) > 1


def check_gloo_address(hostname: str, spans_hosts: bool, environ: Mapping[str, str]) -> None:
    """gloo listens on the address the host name resolves to. Many container and cloud
    setups map it to 127.0.1.1, which other nodes cannot reach: the job would fail later
    with gloo's "connectFullMesh failed" or hang. Say so before the first collective."""
    if not spans_hosts or "GLOO_SOCKET_IFNAME" in environ:
        return
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        address = ""  # unresolvable: gloo falls back to the loopback address
    if not address or address.startswith("127."):
        raise UsageError(
            f"this host's name {hostname!r} resolves to {address or 'nothing'}, which other nodes cannot reach; "
            "set GLOO_SOCKET_IFNAME to the interface between the nodes (e.g. GLOO_SOCKET_IFNAME=eth0 or ib0; "
            "`ip -br addr` lists them)"
        )


def shorten_timeout_after_first_step(optimizer: torch.optim.Optimizer, minutes: float, groups=()) -> None:
    """Once the optimizer has taken its first step, a collective that waits longer than
    `minutes` fails the run (on the default group and `groups`). Setup may take long
    (loading, compiling, NCCL's first connections); a step, an evaluation or a save should
    not, and a hang then costs `minutes`, not the setup's timeout."""
    if get_world_size() == 1:
        return

    shortened = False

    def shorten(*_) -> None:
        # Once. Not removed from inside: the optimizer is iterating over its hooks.
        nonlocal shortened
        if not shortened:
            timeout = datetime.timedelta(minutes=minutes)
            for group in (None, *(g for g in groups if g is not None)):
                dist.set_timeout(timeout, group=group)
            shortened = True

    optimizer.register_step_post_hook(shorten)


{%- if cookiecutter.run_record %}


def flight_recorder_file() -> Path | None:
    """Where this rank's flight recorder goes (NCCL's watchdog writes it there on a
    timeout; `dump_flight_recorder` for gloo), or None when it is off."""
    name = "TORCH_FR_DUMP_TEMP_FILE"
    prefix = os.environ.get(name, os.environ.get(OLDER_NAMES[name]))
    return Path(f"{prefix}{get_rank()}") if prefix else None


def dump_flight_recorder() -> None:
    """Write this rank's flight recorder to `flight_recorder_file()`, unless NCCL's
    watchdog has. Call it before leaving the process group: it names the groups only
    while they exist."""
    path = flight_recorder_file()
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)  # no public API yet
    if path is None or dump is None or path.exists():
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dump())
{%- endif %}


def lost_peer(error: BaseException | None) -> bool:
    """A collective failed because another process died or stopped answering. gloo
    reports this as a plain RuntimeError, so its messages are recognised too."""
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(error, RuntimeError) and bool(
        re.search(r"Connection (closed|reset)|[Tt]imed out|timeout|Broken pipe", str(error))
    )


def init_method(env: DistEnv) -> str:
    if env.launcher == "slurm":
        return f"tcp://{env.master_addr}:{env.master_port}"
    return "env://"


def cleanup_distributed() -> None:
    """Leave the process group. Call it from a `finally`: the error passing through, if
    any, decides how. Ranks that all leave (the work is done, or every rank raised the
    same agreed error) first wait for each other: with lazy gloo a rank may still be
    opening a connection to a peer, and a peer that closes it meanwhile aborts the
    process at exit (SIGABRT, gloo's "state_ <= CONNECTED"). A rank leaving alone never
    waits, so a failure cannot hang{{ "; one leaving because a collective failed writes its
    flight recorder" if cookiecutter.run_record }}."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    error = sys.exc_info()[1]
    if error is None or getattr(error, "agreed", False):
        with contextlib.suppress(RuntimeError):  # a peer gone meanwhile: leave anyway
            dist.barrier()  # on the device bound at init (device_id): never a guess at GPU 0
{%- if cookiecutter.run_record %}
    elif lost_peer(error):
        dump_flight_recorder()
{%- endif %}
    dist.destroy_process_group()


def get_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # os.environ itself, not a copy: a single process asks at every step, and copying
    # the whole environment took ~30 us of a small step.
    try:
        return parse_dist_env(os.environ).rank
    except UsageError:  # a malformed launch: each process reports it, there is no rank 0 to leave it to
        return 0


def get_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_main() -> bool:
    """True on global rank 0: the one process that logs and writes checkpoints."""
    return get_rank() == 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all processes, in place; every rank must call this."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def vote(values: list[float], op: str, group=None, device: torch.device | None = None) -> list[float]:
    """The one all-rank vote: each of `values` reduced over every rank of `group` ("min" or
    "max"). The stop requests and a stream's equal steps vote on the run's stop-vote group
    (CPU, gloo); None is the default group, whose tensors live on `device`. Both groups'
    timeouts drop to dist.step_timeout_minutes after the first step, so a rank that never
    votes fails the others in that time. Every rank of the group must call this."""
    if get_world_size() == 1:
        return values
    tally = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tally, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
    return tally.tolist()


def all_reduce_max_(tensor: torch.Tensor) -> torch.Tensor:
    """The largest `tensor` over all processes, in place; every rank must call this."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


@contextlib.contextmanager
def stop_all_if_any_fails(device: torch.device):
    """Run the body on every rank, then agree: if it failed on any rank, every rank
    stops, and only the lowest failing rank says why (one line, not one per process).

    Every rank must enter it. Wrap work that can fail on some ranks only (rank 0 writing
    a file, reading data) so no rank is left waiting in its next collective:
        with stop_all_if_any_fails(device):
            if is_main():
                save_config(cfg, path)
    """
    error = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001  every rank must reach the all-reduce below
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
    """Mark an error that every rank raises together: they can still leave together."""
    error.agreed = True
    return error


def prepare_on_node_leaders(prepare, cfg, env: DistEnv, device: torch.device) -> None:
    """`prepare(cfg)` (downloading or unpacking data) on global rank 0 first, then on local
    rank 0 of every other node (for node-local storage), while the other ranks wait:
    never two writers at once on shared storage. Every rank must call this."""
    for leaders_now in (env.rank == 0, env.local_rank == 0 and env.rank != 0):
        with stop_all_if_any_fails(device):
            if leaders_now:
                prepare(cfg)


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (e.g. BatchNorm running statistics, which each
    rank updates from its own batches unless SyncBatchNorm spans them), so all ranks
    evaluate the model that rank 0 saves. Every rank must call this."""
    if get_world_size() > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order; every rank must call this."""
    if get_world_size() == 1:
        return [obj]
    gathered = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_objects_on_main(obj) -> list | None:
    """Every rank's `obj` in rank order on rank 0, None elsewhere; every rank must call this."""
    if get_world_size() == 1:
        return [obj]
    gathered = [None] * get_world_size() if is_main() else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def broadcast_from_main(obj):
    """Rank 0's `obj` on every rank; every rank must call this."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
