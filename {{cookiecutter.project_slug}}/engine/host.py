"""The host process's settings for the training steps: glibc's allocator thresholds, and
Python's garbage collector kept out of the steps."""

import ctypes
import gc
import os
import platform

# glibc's mallopt() parameters, and the values the training steps run with (set_host_allocator):
# blocks up to 256 MiB come from the heap, and up to 512 MiB of free memory stays at its top.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEPS_REUSE_FREED = {M_MMAP_THRESHOLD: 256 * 2**20, M_TRIM_THRESHOLD: 512 * 2**20}
# The same settings made at launch, which win: variables, and names in GLIBC_TUNABLES.
SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
LAUNCH_VARIABLES = [f"MALLOC_{name.upper()}_" for name in SETTINGS]
TUNABLES = [f"glibc.malloc.{name}" for name in SETTINGS]


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


def set_host_allocator(parts=()) -> bool:
    """Fix glibc's allocator thresholds for the training steps: a part's own settings
    (`Part.host_allocator`, e.g. FSDP's), else STEPS_REUSE_FREED. Returns whether they
    were set: not where the launch set them, nor with another C library.

    With glibc's defaults, a block above an adaptive threshold (at most 32 MiB) gets its
    own mmap and goes back to the kernel when freed, and the threshold rises to the size
    of each such block freed. Fixing it stops it moving. A step frees and allocates the
    same activations every time: with the defaults each CPU step page-faulted them in
    anew, about 31,000 faults per ResNet-18 step (batch 32), 5% of its time. On a GPU the
    step's tensors are in CUDA's caching allocator, which keeps what it frees; the host
    heap still holds the batches that `num_workers=0` collates in this process, and
    workers started later inherit the setting.

    Call it before setup, as soon as the parts are known: what setup frees is then kept
    too (up to 512 MiB at the heap's top), for the steps to reuse. The same settings
    made at launch (MALLOC_TRIM_THRESHOLD_ etc., or in GLIBC_TUNABLES) win.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(name in os.environ for name in LAUNCH_VARIABLES) or any(name in tunables for name in TUNABLES):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    settings = next((part.host_allocator for part in parts if part.host_allocator), STEPS_REUSE_FREED)
    return all([libc.mallopt(parameter, value) for parameter, value in settings.items()])
