"""Which processes hold memory on this node's GPUs, as the driver (NVML) sees them.

torch.cuda's allocator statistics count only this process's own tensors on its own GPU.
Another process's CUDA context or tensors on GPU 0 never show there: every rank loading
a checkpoint onto GPU 0, a CUDA call before `set_device`, a leftover process of an
earlier run. NVML lists every process on every GPU of the node. It comes with the
optional package nvidia-ml-py (`pip install -e ".[gpu]"`), imported only when used.

Each node's local rank 0 asks NVML about its own node: local calls, no collective, the
same work on every node however many nodes the job has.
"""

import importlib.util
import os
import socket
from dataclasses import dataclass

import torch

from engine.distributed import get_rank, is_main, parse_dist_env
from engine.logs import log

# select_device binds each process of the job to a GPU of its own (cuda:local_rank, or
# the one GPU it sees), so a GPU holds one of the job's processes at most.
EXPECTED_PER_GPU = 1
SKIPPED = {
    "no gpu": "GPU memory by process: skipped (no GPU)",
    "no nvml": (
        'GPU memory by process: skipped, it needs nvidia-ml-py: pip install -e ".[gpu]" (or pip install nvidia-ml-py)'
    ),
}


@dataclass(frozen=True)
class GpuUsage:
    """One GPU this process sees, as NVML reports it. Bytes; a process's bytes are None
    where the driver does not tell."""

    cuda_index: int  # torch's index: cuda:N in this process
    nvml_index: int  # the index nvidia-smi shows
    used: int
    total: int
    processes: list[tuple[int, int | None]]  # (pid, bytes)

    @property
    def name(self) -> str:
        return f"cuda:{self.cuda_index} (nvidia-smi GPU {self.nvml_index})"


def gpu_section_choice(device_type: str, has_nvml: bool, rank: int, local_rank: int) -> str:
    """What this process does for the GPU section of a memory report: "read" NVML (each
    node's local rank 0, on CUDA with nvidia-ml-py installed); "no gpu" or "no nvml"
    (global rank 0 says the section is skipped, see SKIPPED); or "nothing"."""
    if device_type == "cuda" and has_nvml:
        return "read" if local_rank == 0 else "nothing"
    if rank != 0:
        return "nothing"
    return "no nvml" if device_type == "cuda" else "no gpu"


def mib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:.0f}"


def gpu_table(host: str, when: str, gpus: list[GpuUsage]) -> str:
    """Per GPU of the node: memory in use, then each process holding some."""
    rows = [f"GPU memory by process on {host}, MiB ({when}):"]
    for gpu in gpus:
        held = ", ".join(f"pid {pid} {mib(size)}" for pid, size in gpu.processes) or "no process"
        rows.append(f"  {gpu.name}: {mib(gpu.used)} of {mib(gpu.total)} in use; {held}")
    return "\n".join(rows)


def extra_process_warnings(host: str, gpus: list[GpuUsage], expected: int = EXPECTED_PER_GPU) -> list[str]:
    """One line per GPU holding more processes than the job puts there. Processes are
    counted, not matched to this job's pids: in a container NVML reports the host's pids."""
    return [
        f"warning: {host}: {gpu.name} holds {len(gpu.processes)} processes, expected {expected} at most ("
        + ", ".join(f"pid {pid} {mib(size)} MiB" for pid, size in gpu.processes)
        + "): another process has memory there, e.g. a rank that loaded a checkpoint without map_location or "
        "used CUDA before set_device, or a leftover of an earlier run; check nvidia-smi, end leftovers"
        for gpu in gpus
        if len(gpu.processes) > expected
    ]


def read_gpus() -> list[GpuUsage]:
    """Every GPU this process sees, in torch's order, from NVML. NVML numbers all the
    node's GPUs its own way, unchanged by CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, so
    the two are matched by UUID. Raises pynvml.NVMLError, or LookupError for a GPU that
    NVML does not list as a whole device (a MIG instance)."""
    import pynvml  # optional (nvidia-ml-py): only on CUDA, and only here

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        by_uuid = {pynvml.nvmlDeviceGetUUID(handle): index for index, handle in enumerate(handles)}
        gpus = []
        for cuda_index in range(torch.cuda.device_count()):
            # Device attributes only: no CUDA context on that GPU (another rank's).
            uuid = f"GPU-{torch.cuda.get_device_properties(cuda_index).uuid}"
            if uuid not in by_uuid:
                raise LookupError(f"cuda:{cuda_index} ({uuid}) is not among NVML's GPUs (a MIG instance?)")
            index = by_uuid[uuid]
            memory = pynvml.nvmlDeviceGetMemoryInfo(handles[index])
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handles[index])
            held = [(process.pid, process.usedGpuMemory) for process in processes]
            gpus.append(GpuUsage(cuda_index, index, memory.used, memory.total, held))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def nvml_lines(host: str, when: str, main: bool) -> list[str]:
    """What a node's local rank 0 logs: on global rank 0 (`main`) its node's table, on
    any node a warning for each GPU with extra processes. NVML failing is one line on
    rank 0, never an error: the report is advice, the training goes on."""
    import pynvml

    try:
        gpus = read_gpus()
    except (pynvml.NVMLError, LookupError) as error:
        return [f"GPU memory by process: skipped on {host}, NVML failed: {error}"] if main else []
    return ([gpu_table(host, when, gpus)] if main else []) + extra_process_warnings(host, gpus)


def report_gpu_processes(device: torch.device, when: str, say_skipped: bool = True) -> None:
    """The GPU section of a memory report: global rank 0 logs its node's GPUs (processes
    and their memory), each node's local rank 0 a warning for a GPU of its node with extra
    processes. No collective: any rank may call it, and ranks need not call it together.
    `say_skipped=False`: nothing when the section is skipped (said once at the start)."""
    local_rank = parse_dist_env(os.environ).local_rank
    has_nvml = importlib.util.find_spec("pynvml") is not None
    choice = gpu_section_choice(device.type, has_nvml, get_rank(), local_rank)
    if choice in SKIPPED:
        if say_skipped:
            log(SKIPPED[choice])
    elif choice == "read":
        for line in nvml_lines(socket.gethostname(), when, main=is_main()):
            log(line)
