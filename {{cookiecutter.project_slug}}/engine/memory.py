"""Memory: what each rank holds, reported so that imbalance and growth show.

The classic distributed memory problems are made visible here: one rank (usually GPU 0)
holding far more than the others, e.g. because every process loaded a checkpoint onto it,
and memory that grows epoch after epoch (a leak). What other processes hold on a GPU is
not in a rank's own figures: engine.gpu_processes asks the driver.
"""

import ctypes
import gc
import os
import platform
import resource
import statistics
import warnings

import torch
from torch.distributed.tensor import DTensor

from engine.distributed import gather_objects_on_main, is_main
from engine.gpu_processes import report_gpu_processes
from engine.logs import log

IMBALANCE = 1.25  # warn when a rank holds more than this times the median
TABLE_ROWS = 16  # the table's rows at most: two nodes of 8 GPUs show in full

# glibc's mallopt() parameters, and the values the training steps run with (set_host_allocator).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCKS_UP_TO = 256 * 2**20  # blocks up to this size come from the heap, not their own mmap
KEEP_FREE_AT_HEAP_TOP = 512 * 2**20  # free memory kept at the heap's top, not given back
OWN_MMAP_ABOVE = 128 * 2**10  # under FSDP: glibc's initial threshold, fixed (it no longer rises)
# The same settings made at launch, which win: variables, and names in GLIBC_TUNABLES.
SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
LAUNCH_VARIABLES = [f"MALLOC_{name.upper()}_" for name in SETTINGS]
TUNABLES = [f"glibc.malloc.{name}" for name in SETTINGS]


def memory_snapshot(device: torch.device) -> dict:
    """This process's memory in MiB: peak and current RSS, and on CUDA its GPU's peaks
    allocated and reserved by this process since the last report (the first: since the
    start; `report_memory` restarts them), while `rss_peak_mib` is since the start.
    Counting live tensors walks every Python object (~0.1 s): call it between epochs."""
    page_mib = resource.getpagesize() / 2**20
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    snapshot = {
        "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_mib": round(rss_pages * page_mib, 1),
        **c_heap_mib(),
        "live_tensors": count_live_tensors(),
    }
    if device.type == "cuda":
        snapshot["cuda_allocated_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        snapshot["cuda_reserved_peak_mib"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
    return snapshot


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc 2.33 and later), all fields size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def c_heap_mib() -> dict:
    """The C heap in MiB, from glibc's mallinfo2: what is handed out (`heap_used_mib`,
    tensor storage among it) and what is free but kept (`heap_kept_mib`, the cache
    `set_host_allocator` asks for). RSS is roughly both plus Python's own small
    objects and the libraries; it cannot tell a cache from a leak, these can. Empty where
    there is no glibc 2.33."""
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


def freeze_setup_objects() -> None:
    """Keep Python's full garbage collections out of the training steps.

    A full collection walks every object (~0.1 s once torch is imported) and starts at a
    different step on each rank, where the other ranks then wait for it. What setup made
    lives for the whole run: collect once, then freeze it, so later collections only walk
    what the loop makes. `gc.unfreeze()` undoes it.
    """
    gc.collect()
    gc.freeze()


def set_host_allocator(sharded: bool) -> bool:
    """Fix glibc's allocator thresholds for the training steps. Returns whether it was
    set: not where the launch set it, nor with another C library.

    With glibc's defaults, a block above an adaptive threshold (at most 32 MiB) gets its
    own mmap and goes back to the kernel when freed, and the threshold rises to the size
    of each such block freed. Both settings below fix it, so it stops moving.
    - DDP, one process: blocks up to 256 MiB come from the heap and stay there when
      freed (up to 512 MiB at the heap's top). A step frees and allocates the same
      activations every time; with the defaults each CPU step page-faulted them in anew,
      about 31,000 faults per ResNet-18 step (batch 32), 5% of its time.
    - FSDP (`sharded`): blocks above glibc's initial 128 KiB get their own mmap and go
      back when freed. Each block's parameters are gathered whole and its gradients
      made whole for every use, then freed, in blocks of every size: kept in the heap,
      they fragment it and the sharding's saving is lost. Measured on a 101M-parameter
      MLP of 24 blocks with AdamW on 2 CPU processes, the step's peak RSS per rank was
      1,590 MiB with this, 2,827-3,172 with glibc's defaults and 3,147-3,347 with the
      DDP setting (DDP itself: 2,443-2,531 with its setting, 2,397 with this one).
    On a GPU the step's tensors are in CUDA's caching allocator, which keeps what it
    frees; the host heap still holds the batches that `num_workers=0` collates in this
    process, and workers started later inherit the setting.

    Call it before setup, as soon as the strategy is known: with glibc's defaults the
    threshold rises with the first large block freed, and FSDP's setup frees one full
    tensor after another on every rank (each received whole from rank 0, then cut to its
    shard). They then stay in a fragmented heap: with a 12-block MLP of 49 MiB on 2 CPU
    processes, rank 1 held 2.3-2.7x the weights above its start when its first step
    began, 0.52x (its half, and the rest) with the setting made first. Under DDP what
    setup frees is kept too (up to 512 MiB at the heap's top), for the steps to reuse.
    The same settings made at launch (MALLOC_TRIM_THRESHOLD_ etc., or in GLIBC_TUNABLES)
    win, and other C libraries are left alone.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(name in os.environ for name in LAUNCH_VARIABLES) or any(name in tunables for name in TUNABLES):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if sharded:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, OWN_MMAP_ABOVE))
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_AT_HEAP_TOP)
    )


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
        log(f"memory per rank, MiB ({when}):\n{memory_table(per_rank)}")
        warning = imbalance_warning(per_rank)
        if warning:
            log(warning)
    report_gpu_processes(device, when, say_skipped=False)  # said once, at the start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return per_rank
