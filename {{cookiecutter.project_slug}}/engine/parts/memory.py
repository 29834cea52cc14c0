"""The memory report (a part): every rank's memory each epoch, so imbalance and leaks show; and,
from NVML (optional nvidia-ml-py), the processes on each node's GPUs, which torch.cuda cannot see."""

import ctypes
import gc
import importlib.util
import os
import platform
import resource
import socket
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from engine.distributed import gather_objects_on_main, get_rank, is_main, parse_dist_env
from engine.hooks import Part
from engine.logs import log

HOST_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"  # torch's own MemoryError


def error_line(error: BaseException) -> str | None:
    """The line a process out of host memory ends with (engine/logs.py asks each part module)."""
    if isinstance(error, MemoryError) or HOST_ALLOCATION_FAILED in str(error):  # data, batch or model
        return (
            "out of host memory; use smaller data, batches (train.batch_size) or model, fewer DataLoader workers, "
            "or a machine with more memory"
        )
    return None


def build(cfg, env) -> "MemoryReport":
    return MemoryReport()


class MemoryReport(Part):
    name = "memory"

    def start(self, state) -> None:
        report_gpu_processes(state.device, "start")  # after the resume: what a load left shows

    def epoch_figures(self, state) -> dict:
        return {"memory": report_memory(state.device, f"epoch {state.epoch}", train_state_mib(state))}


IMBALANCE = 1.25  # warn when a rank holds more than this times the median
TABLE_ROWS = 16  # two nodes of 8 GPUs show in full
STATM = Path("/proc/self/statm")  # Linux's: this process's memory, in pages
UNREADABLE = {"rss_mib": f"no {STATM}", "heap_used_mib": "no glibc mallinfo2"}  # figures a system may lack


class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]


def c_heap_mib() -> dict:
    """The C heap in MiB (glibc 2.33's mallinfo2, else {}): handed out (`heap_used_mib`) and
    free but kept (`heap_kept_mib`, a cache). RSS cannot tell a cache from a leak; these can."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {
        "heap_used_mib": round((info.uordblks + info.hblkhd) / 2**20, 1),
        "heap_kept_mib": round(info.fordblks / 2**20, 1),
    }


def memory_snapshot(device: torch.device) -> dict:
    per_mib = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
    snapshot = {"rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib, 1)}
    if STATM.is_file():
        snapshot["rss_mib"] = round(int(STATM.read_text().split()[1]) * resource.getpagesize() / 2**20, 1)
    # Tensors counted by type(): it neither wakes a dead weak proxy nor pokes deprecated torch objects.
    snapshot |= c_heap_mib() | {"live_tensors": sum(issubclass(type(obj), torch.Tensor) for obj in gc.get_objects())}
    if device.type == "cuda":
        peaks = {"allocated": torch.cuda.max_memory_allocated, "reserved": torch.cuda.max_memory_reserved}
        snapshot |= {f"cuda_{kind}_peak_mib": round(peak(device) / 2**20, 1) for kind, peak in peaks.items()}
    return snapshot


def imbalance_key(per_rank: list[dict]) -> str:
    return "cuda_reserved_peak_mib" if "cuda_reserved_peak_mib" in per_rank[0] else "rss_peak_mib"


def memory_table(per_rank: list[dict], most_rows: int = TABLE_ROWS) -> str:
    keys, key = list(per_rank[0]), imbalance_key(per_rank)
    width = max(map(len, keys)) + 1
    shown = sorted(range(1, len(per_rank)), key=lambda rank: per_rank[rank][key], reverse=True)[: most_rows - 1]
    shown = [0, *sorted(shown)] if len(per_rank) > most_rows else range(len(per_rank))
    rows = ["rank " + "".join(f"{k:>{width}}" for k in keys)]
    rows += [f"{rank:>4} " + "".join(f"{per_rank[rank][k]:>{width}g}" for k in keys) for rank in shown]
    if len(shown) < len(per_rank):
        rows.append(f"({len(per_rank) - len(shown)} more ranks hold less {key}: see metrics.jsonl)")
    return "\n".join(rows)


def imbalance_warning(per_rank: list[dict]) -> str | None:
    key = imbalance_key(per_rank)
    values = [row[key] for row in per_rank]
    median, worst = statistics.median(values), max(values)
    if len(values) > 1 and median > 0 and worst > IMBALANCE * median:
        return (
            f"warning: rank {values.index(worst)} holds {worst:.0f} MiB ({key}), {worst / median:.1f}x the "
            "median: look for work or tensors placed on one rank (e.g. loads not mapped to CPU)"
        )
    return None


def train_state_mib(state) -> dict:
    def local_mib(tensors) -> float:
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if isinstance(t, torch.Tensor)]
        return round(sum(t.nbytes for t in tensors) / 2**20, 1)

    slots = [value for slots in state.optimizer.state.values() for value in slots.values()]
    return {"params_mib": local_mib(state.model.parameters()), "optimizer_mib": local_mib(slots)}


def report_memory(device: torch.device, when: str, held: dict | None = None) -> list[dict] | None:
    """Every rank must call this; returns the figures on rank 0. CUDA peaks restart on every rank alike."""
    per_rank = gather_objects_on_main({**memory_snapshot(device), **(held or {})})
    if is_main():
        missing = ", ".join(f"{key} ({why})" for key, why in UNREADABLE.items() if key not in per_rank[0])
        log(f"memory per rank, MiB ({when}{'; not read here: ' + missing if missing else ''}):")
        log(memory_table(per_rank))
        if warning := imbalance_warning(per_rank):
            log(warning)
    report_gpu_processes(device, when, say_skipped=False)  # said once, at the start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return per_rank


SKIPPED = {
    "no gpu": "GPU memory by process: skipped (no GPU)",
    "no nvml": (
        'GPU memory by process: skipped, it needs nvidia-ml-py: pip install -e ".[gpu]" (or pip install nvidia-ml-py)'
    ),
}


@dataclass(frozen=True)
class GpuUsage:
    cuda_index: int  # cuda:N in this process
    nvml_index: int  # the index nvidia-smi shows
    used: int
    total: int
    processes: list[tuple[int, int | None]]  # (pid, bytes)

    @property
    def name(self) -> str:
        return f"cuda:{self.cuda_index} (nvidia-smi GPU {self.nvml_index})"


def gpu_section_choice(device_type: str, has_nvml: bool, rank: int, local_rank: int) -> str:
    if device_type == "cuda" and has_nvml:
        return "read" if local_rank == 0 else "nothing"
    return "nothing" if rank else ("no nvml" if device_type == "cuda" else "no gpu")


def mib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:.0f}"


def gpu_table(host: str, when: str, gpus: list[GpuUsage]) -> str:
    rows = [f"GPU memory by process on {host}, MiB ({when}):"]
    for gpu in gpus:
        held = ", ".join(f"pid {pid} {mib(size)}" for pid, size in gpu.processes) or "no process"
        rows.append(f"  {gpu.name}: {mib(gpu.used)} of {mib(gpu.total)} in use; {held}")
    return "\n".join(rows)


def extra_process_warnings(host: str, gpus: list[GpuUsage]) -> list[str]:
    # Counted, not matched to the job's pids: a container's NVML gives the host's. At most 1: select_device gives
    # each process a GPU of its own.
    return [
        f"warning: {host}: {gpu.name} holds {len(gpu.processes)} processes, expected 1 at most ("
        + ", ".join(f"pid {pid} {mib(size)} MiB" for pid, size in gpu.processes)
        + "): another process has memory there, e.g. a rank that loaded a checkpoint without map_location or "
        "used CUDA before set_device, or a leftover of an earlier run; check nvidia-smi, end leftovers"
        for gpu in gpus
        if len(gpu.processes) > 1
    ]


def read_gpus() -> list[GpuUsage]:
    import pynvml  # optional (nvidia-ml-py)

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        by_uuid = {pynvml.nvmlDeviceGetUUID(handle): index for index, handle in enumerate(handles)}
        gpus = []
        for cuda_index in range(torch.cuda.device_count()):
            uuid = f"GPU-{torch.cuda.get_device_properties(cuda_index).uuid}"  # no CUDA context on that GPU
            if uuid not in by_uuid:
                raise LookupError(f"cuda:{cuda_index} ({uuid}) is not among NVML's GPUs (a MIG instance?)")
            memory = pynvml.nvmlDeviceGetMemoryInfo(handles[by_uuid[uuid]])
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handles[by_uuid[uuid]])
            held = [(process.pid, process.usedGpuMemory) for process in processes]
            gpus.append(GpuUsage(cuda_index, by_uuid[uuid], memory.used, memory.total, held))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def nvml_lines(host: str, when: str, main: bool) -> list[str]:
    import pynvml

    try:
        gpus = read_gpus()
    except (pynvml.NVMLError, LookupError) as error:
        return [f"GPU memory by process: skipped on {host}, NVML failed: {error}"] if main else []
    return ([gpu_table(host, when, gpus)] if main else []) + extra_process_warnings(host, gpus)


def report_gpu_processes(device: torch.device, when: str, say_skipped: bool = True) -> None:
    """No collective: any rank may call it alone."""
    has_nvml = importlib.util.find_spec("pynvml") is not None
    choice = gpu_section_choice(device.type, has_nvml, get_rank(), parse_dist_env(os.environ).local_rank)
    if choice in SKIPPED and say_skipped:
        log(SKIPPED[choice])
    elif choice == "read":
        for line in nvml_lines(socket.gethostname(), when, main=is_main()):
            log(line)
