"""Speed in the task's own units, and the model FLOPs utilisation (MFU).

Items: model.py may define `count_items(batch) -> (unit, count)`, e.g. ("tokens", the
batch's non-padding tokens); the run then reports `<unit>_per_s` beside samples_per_s.

MFU: the FLOPs of one training micro-batch (forward and backward, as torch's
FlopCounterMode counts them on this process's first one), times micro-batches per
second, over the device's peak. The peak is train.peak_tflops, or else the data sheet's
dense bf16/fp16 figure for the GPUs in PEAK_TFLOPS under bf16 or fp16 precision; with
neither, no FLOPs are counted and no MFU is reported. Recomputed activations
(train.activation_checkpointing) count as FLOPs done.
"""

import contextlib
import re

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.errors import TaskError

# Dense bf16/fp16 tensor-core TFLOPS per GPU (FP32 accumulation), from NVIDIA's data sheets,
# by a whole word of torch.cuda.get_device_name() (L4 is not L40, A100 not A1000); the first
# match counts, so longer names first.
PEAK_TFLOPS = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("V100", 125.0),  # fp16 only: it has no bf16
)


def peak_flops(configured_tflops: float, device_name: str | None, precision: str) -> float | None:
    """FLOPs per second one device can do: train.peak_tflops if set, else the table's figure
    for a GPU's name under bf16 or fp16; None when unknown (CPU, fp32, an unlisted GPU)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device_name is None or precision not in ("bf16", "fp16"):
        return None
    for name, tflops in PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(name)}\b", device_name) and not (name == "V100" and precision == "bf16"):
            return tflops * 1e12
    return None


def device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


class Throughput:
    """The task's items (model.py's `count_items`), summed on the device (no host sync per
    step), and the FLOPs of one micro-batch, counted once when a peak is known."""

    def __init__(self, count_items=None, peak: float | None = None, device: torch.device | None = None):
        self.count_items, self.peak = count_items, peak
        self.unit = None
        self.items = torch.zeros((), dtype=torch.float64, device=device)  # counts given as tensors
        self.host_items = 0.0  # counts given as numbers: copying each to the device would sync the host
        self.flops_per_micro_batch = None

    @classmethod
    def of_run(cls, cfg, device: torch.device, count_items) -> "Throughput":
        return cls(count_items, peak_flops(cfg.train.peak_tflops, device_name(device), cfg.train.precision), device)

    def counting_flops(self):
        """Around a micro-batch's forward and backward: counts the first one's FLOPs."""
        if self.peak is None or self.flops_per_micro_batch is not None:
            return contextlib.nullcontext()
        return FlopsOnce(self)

    def add(self, batch) -> None:
        if self.count_items is not None:
            counted = self.count_items(batch)
            pair = isinstance(counted, tuple) and len(counted) == 2 and isinstance(counted[0], str)
            number = pair and isinstance(counted[1], int | float) and not isinstance(counted[1], bool)
            try:
                count = torch.as_tensor(counted[1], device=self.items.device) if pair and not number else None
            except (TypeError, ValueError, RuntimeError):  # not a number
                count = None
            if not number and (count is None or count.numel() != 1):
                raise TaskError(
                    f"count_items returned {type(counted).__name__} {str(counted)[:60]!r}; return (unit, count) with "
                    'one number, e.g. ("tokens", mask.sum())'
                )
            self.unit = counted[0]
            if number:
                self.host_items += counted[1]
            else:
                self.items += count.to(torch.float64).reshape(())

    def total_items(self) -> torch.Tensor:
        """This rank's items since the last reset, on the device."""
        return self.items + self.host_items

    def reset(self) -> None:
        self.items.zero_()
        self.host_items = 0.0

    def figures(self, items_total: float, micro_batches: int, elapsed: float) -> dict:
        """<unit>_per_s over every rank; model_tflops_per_s and mfu per device (this one's
        `micro_batches`), as far as they are known."""
        figures = {}
        if self.unit is not None:
            figures[f"{self.unit}_per_s"] = items_total / max(elapsed, 1e-9)
        if self.flops_per_micro_batch is not None:
            achieved = self.flops_per_micro_batch * micro_batches / max(elapsed, 1e-9)
            figures |= {"model_tflops_per_s": achieved / 1e12, "mfu": achieved / self.peak}
        return figures


class FlopsOnce(FlopCounterMode):
    """FlopCounterMode, its total kept in a Throughput when it ends."""

    def __init__(self, throughput: Throughput):
        super().__init__(display=False)
        self.throughput = throughput

    def __exit__(self, *exc_info):
        result = super().__exit__(*exc_info)
        self.throughput.flops_per_micro_batch = float(self.get_total_flops())
        return result
