"""The memory report (a part): what each rank holds, each epoch, so that imbalance and
growth show, and which processes hold memory on the node's GPUs.

The classic distributed memory problems are made visible here: one rank (usually GPU 0)
holding far more than the others, e.g. because every process loaded a checkpoint onto it,
and memory that grows epoch after epoch (a leak). Each epoch's figures of every rank go to
metrics.jsonl ("memory"), and rank 0 prints them as a table.

What other processes hold on a GPU is not in a rank's own figures: torch.cuda's allocator
statistics count only this process's own tensors on its own GPU. Another process's CUDA
context or tensors on GPU 0 never show there: every rank loading
a checkpoint onto GPU 0, a CUDA call before `set_device`, a leftover process of an
earlier run. NVML lists every process on every GPU of the node. It comes with the
optional package nvidia-ml-py (`pip install -e ".[gpu]"`), imported only when used.

Each node's local rank 0 asks NVML about its own node: local calls, no collective, the
same work on every node however many nodes the job has.
"""

import gc
import importlib.util
import os
import resource
import socket
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from engine.distributed import gather_objects_on_main, get_rank, is_main, parse_dist_env
from engine.logs import log
from engine.parts import Part
from engine.training import c_heap_mib


def build(cfg, env) -> "MemoryReport":
    return MemoryReport()


class MemoryReport(Part):
    """At the start (after the resume): the GPU processes; each epoch: every rank's memory."""

    name = "memory"

    def start(self, state) -> None:
        report_gpu_processes(state.device, "start")  # what a load left on another rank's GPU shows

    def epoch_figures(self, state) -> dict:
        held = train_state_mib(state.model, state.optimizer)
        return {"memory": report_memory(state.device, f"epoch {state.epoch}", held)}


IMBALANCE = 1.25  # warn when a rank holds more than this times the median
TABLE_ROWS = 16  # the table's rows at most: two nodes of 8 GPUs show in full


def memory_snapshot(device: torch.device) -> dict:
    """This process's memory in MiB: peak and current RSS, and on CUDA its GPU's peaks
    allocated and reserved by this process since the last report (the first: since the
    start; `report_memory` restarts them), while `rss_peak_mib` is since the start.
    Counting live tensors walks every Python object (~0.1 s): call it between epochs."""
    snapshot = {
        **resident_mib(),
        **c_heap_mib(),
        "live_tensors": count_live_tensors(),
    }
    if device.type == "cuda":
        snapshot["cuda_allocated_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        snapshot["cuda_reserved_peak_mib"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
    return snapshot


STATM = Path("/proc/self/statm")  # Linux's: this process's memory, in pages
# Figures a system may not give, and why: the report says which it could not read.
UNREADABLE = {"rss_mib": f"no {STATM}", "heap_used_mib": "no glibc mallinfo2"}


def resident_mib() -> dict:
    """This process's resident memory in MiB: its peak, and its current size where /proc
    tells it (Linux; not macOS)."""
    per_mib = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
    figures = {"rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib, 1)}
    try:
        pages = int(STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return figures
    return figures | {"rss_mib": round(pages * resource.getpagesize() / 2**20, 1)}


def unread(row: dict) -> str:
    missing = [f"{key} ({why})" for key, why in UNREADABLE.items() if key not in row]
    return f"; not read here: {', '.join(missing)}" if missing else ""


def count_live_tensors() -> int:
    """Tensors the garbage collector tracks, those frozen at setup excepted: a count that
    grows from epoch to epoch means a leak."""
    count = 0
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch objects
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                count += isinstance(obj, torch.Tensor)
            except ReferenceError:  # a weak proxy whose object is gone (torch.compile keeps some)
                pass
    return count


def gather_memory(device: torch.device, held: dict) -> list[dict] | None:
    """Every rank's snapshot, in rank order, on rank 0 (None elsewhere): a few hundred
    bytes a rank, once an epoch. Every rank must call this."""
    return gather_objects_on_main({**memory_snapshot(device), **held})


def memory_table(per_rank: list[dict], most_rows: int = TABLE_ROWS) -> str:
    """A row per rank; for more ranks than `most_rows`, rank 0's and those holding the
    most (every rank's figures still go to metrics.jsonl)."""
    keys = list(per_rank[0])
    width = max(len(k) for k in keys) + 1
    header = "rank " + "".join(f"{k:>{width}}" for k in keys)
    key = imbalance_key(per_rank)
    shown = list(range(len(per_rank)))
    if len(per_rank) > most_rows:
        heaviest = sorted(shown[1:], key=lambda rank: per_rank[rank][key], reverse=True)[: most_rows - 1]
        shown = [0, *sorted(heaviest)]
    rows = [f"{rank:>4} " + "".join(f"{per_rank[rank][k]:>{width}g}" for k in keys) for rank in shown]
    if len(shown) < len(per_rank):
        rows.append(f"({len(per_rank) - len(shown)} more ranks hold less {key}: see metrics.jsonl)")
    return "\n".join([header, *rows])


def imbalance_key(per_rank: list[dict]) -> str:
    return "cuda_reserved_peak_mib" if "cuda_reserved_peak_mib" in per_rank[0] else "rss_peak_mib"


def imbalance_warning(per_rank: list[dict]) -> str | None:
    """One line naming the rank that holds much more than the median, if any."""
    key = imbalance_key(per_rank)
    values = [row[key] for row in per_rank]
    median = statistics.median(values)
    worst = max(range(len(values)), key=values.__getitem__)
    if len(values) > 1 and median > 0 and values[worst] > IMBALANCE * median:
        return (
            f"warning: rank {worst} holds {values[worst]:.0f} MiB ({key}), {values[worst] / median:.1f}x the "
            "median: look for work or tensors placed on one rank (e.g. loads not mapped to CPU)"
        )
    return None


def train_state_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What this rank holds of the weights and of the optimizer state, in MiB: all of it
    under DDP, about 1/N under FSDP (its shards)."""

    def local_mib(tensors) -> float:
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if isinstance(t, torch.Tensor)]
        return round(sum(t.nbytes for t in tensors) / 2**20, 1)

    state = [value for slots in optimizer.state.values() for value in slots.values()]
    return {"params_mib": local_mib(model.parameters()), "optimizer_mib": local_mib(state)}


def report_memory(device: torch.device, when: str, held: dict | None = None) -> list[dict] | None:
    """Gather every rank's memory (and what it `held`, e.g. train_state_mib); rank 0 logs
    a table and any imbalance, then the GPU section (every process on the GPUs, from
    NVML). Every rank must call this. Returns the per-rank figures on rank 0 (for
    metrics.jsonl), None elsewhere.

    Then the CUDA peaks restart, so that each report's peaks are its own period's: a
    peak from setup no longer hides what later epochs take. The imbalance warning still
    compares like with like (every rank restarts at the same point), and memory that
    stays reserved (e.g. a checkpoint loaded onto GPU 0) is the new period's floor."""
    per_rank = gather_memory(device, held or {})
    if is_main():
        log(f"memory per rank, MiB ({when}{unread(per_rank[0])}):\n{memory_table(per_rank)}")
        warning = imbalance_warning(per_rank)
        if warning:
            log(warning)
    report_gpu_processes(device, when, say_skipped=False)  # said once, at the start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return per_rank


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
