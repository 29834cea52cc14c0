"""Memory: what each rank holds, reported so that imbalance and growth show.

The classic distributed memory problems are made visible here: one rank (usually GPU 0)
holding far more than the others, e.g. because every process loaded a checkpoint onto it,
and memory that grows epoch after epoch (a leak).
"""

import gc
import resource
import statistics
import warnings

import torch

from engine.distributed import all_gather_objects, is_main
from engine.logs import log

IMBALANCE = 1.25  # warn when a rank holds more than this times the median


def memory_snapshot(device: torch.device, count_tensors: bool = True) -> dict:
    """This process's memory in MiB: peak and current RSS, and its GPU's peaks on CUDA.
    Counting live tensors walks every Python object (~0.1 s): skip it inside training."""
    page_mib = resource.getpagesize() / 2**20
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    snapshot = {
        "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_mib": round(rss_pages * page_mib, 1),
    }
    if count_tensors:
        snapshot["live_tensors"] = count_live_tensors()
    if device.type == "cuda":
        snapshot["cuda_allocated_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        snapshot["cuda_reserved_peak_mib"] = round(torch.cuda.max_memory_reserved(device) / 2**20, 1)
    return snapshot


def freeze_setup_objects() -> None:
    """Keep Python's full garbage collections out of the training steps.

    A full collection walks every object (~0.1 s once torch is imported) and starts at a
    different step on each rank, where the other ranks then wait for it. What setup made
    lives for the whole run: collect once, then freeze it, so later collections only walk
    what the loop makes. `gc.unfreeze()` undoes it.
    """
    gc.collect()
    gc.freeze()


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


def gather_memory(device: torch.device, count_tensors: bool = True) -> list[dict]:
    """Every rank's snapshot, in rank order. Every rank must call this."""
    return all_gather_objects(memory_snapshot(device, count_tensors))


def memory_table(per_rank: list[dict]) -> str:
    keys = list(per_rank[0])
    width = max(len(k) for k in keys) + 1
    header = "rank " + "".join(f"{k:>{width}}" for k in keys)
    rows = [f"{rank:>4} " + "".join(f"{row[k]:>{width}g}" for k in keys) for rank, row in enumerate(per_rank)]
    return "\n".join([header, *rows])


def imbalance_warning(per_rank: list[dict]) -> str | None:
    """One line naming the rank that holds much more than the median, if any."""
    key = "cuda_reserved_peak_mib" if "cuda_reserved_peak_mib" in per_rank[0] else "rss_peak_mib"
    values = [row[key] for row in per_rank]
    median = statistics.median(values)
    worst = max(range(len(values)), key=values.__getitem__)
    if len(values) > 1 and median > 0 and values[worst] > IMBALANCE * median:
        return (
            f"warning: rank {worst} holds {values[worst]:.0f} MiB ({key}), {values[worst] / median:.1f}x the "
            "median: look for work or tensors placed on one rank (e.g. loads not mapped to CPU)"
        )
    return None


def report_memory(device: torch.device, when: str, count_tensors: bool = True) -> list[dict]:
    """Gather every rank's memory; rank 0 logs a table and any imbalance. Every rank
    must call this. Returns the per-rank figures (for metrics.jsonl)."""
    per_rank = gather_memory(device, count_tensors)
    if is_main():
        log(f"memory per rank, MiB ({when}):\n{memory_table(per_rank)}")
        warning = imbalance_warning(per_rank)
        if warning:
            log(warning)
    return per_rank
