"""Speed in the task's units (model.py's `count_items`) and model FLOPs utilisation (MFU) from the first micro-batch."""

import contextlib
import importlib
import itertools
import re
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.config import check_positive
from engine.distributed import all_reduce
from engine.errors import TaskError
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {"train.peak_tflops": "throughput.peak_tflops"}


@dataclass
class Section:
    peak_tflops: float = 0.0  # one device's peak, for the MFU figure; 0 = a listed GPU's (PEAK_TFLOPS below)

    def __post_init__(self):
        check_positive("throughput.peak_tflops", self.peak_tflops, allow_zero=True)


def build(cfg, env) -> "Throughput":
    task = importlib.import_module("model")  # the task's model.py, as train.py imports it: its count_items, if any
    return Throughput(getattr(task, "count_items", None), configured=(cfg.throughput.peak_tflops, cfg.train.precision))


# Dense bf16/fp16 TFLOPS, NVIDIA's data sheets; the first whole word of the device name (L4 is not L40) counts.
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
    ("V100", 125.0),
)


def peak_flops(configured_tflops: float, device_name: str | None, precision: str) -> float | None:
    if configured_tflops:
        return configured_tflops * 1e12
    name = device_name or ""
    found = next((tflops for gpu, tflops in PEAK_TFLOPS if re.search(rf"\b{re.escape(gpu)}\b", name)), None)
    known = found and (precision == "fp16" or precision == "bf16" and "V100" not in name)  # V100: no bf16
    return found * 1e12 if known else None


class Throughput(Part):
    name = "throughput"
    measures_steps = True

    def __init__(self, count_items=None, peak: float | None = None, configured: tuple[float, str] | None = None):
        self.count_items, self.peak = count_items, peak
        self.configured = configured  # (throughput.peak_tflops, train.precision): the peak once the device is known
        self.unit = self.flops_per_micro_batch = None
        self.items = torch.zeros((), dtype=torch.float64)  # counts given as tensors
        self.reset_figures()

    def setup(self, state) -> None:
        self.items = self.items.to(state.device)
        if self.configured is not None:
            name = torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else None
            self.peak = peak_flops(self.configured[0], name, self.configured[1])

    @contextlib.contextmanager
    def measure(self, batch):
        with self.counting_flops():  # the first micro-batch's, for the MFU
            yield
        self.add(batch)

    def after_step(self, state) -> None:
        self.step_ends.append(time.perf_counter())

    def reset_figures(self) -> None:
        self.items.zero_()
        self.host_items = 0.0  # counts given as numbers: copying each to the device would sync the host
        self.step_ends = [time.perf_counter()]  # host clock at each optimizer step: no device sync needed

    def log_epoch(self, row: dict) -> None:
        """On rank 0, after the row's own line: the speed in the task's unit, and the MFU if measured."""
        per_s = row.get(f"{self.unit}_per_s")  # absent while the task counts no items
        speed = [] if per_s is None else [f"{per_s:,.0f} {self.unit}/s"]
        speed += [f"MFU {row['mfu']:.1%}"] if "mfu" in row else []
        if speed:
            log(f"epoch {row['epoch']} speed: {', '.join(speed)}")

    def train_figures(self, micro_batches: int, elapsed: float) -> dict:
        items = all_reduce(self.items + self.host_items).item()  # every rank's
        figures = {} if self.unit is None else {f"{self.unit}_per_s": items / max(elapsed, 1e-9)}
        if self.flops_per_micro_batch is not None:
            achieved = self.flops_per_micro_batch * micro_batches / max(elapsed, 1e-9)
            figures |= {"model_tflops_per_s": achieved / 1e12, "mfu": achieved / self.peak}
        step_times = [b - a for a, b in itertools.pairwise(self.step_ends)]
        return figures | {"step_time_median_s": statistics.median(step_times) if step_times else 0.0}

    @contextlib.contextmanager
    def counting_flops(self):
        if self.peak is None or self.flops_per_micro_batch is not None:
            yield
            return
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops_per_micro_batch = float(counter.get_total_flops())

    def add(self, batch) -> None:
        if self.count_items is None:
            return
        counted = self.count_items(batch)
        unit, count = counted if isinstance(counted, tuple) and len(counted) == 2 else (None, None)
        if isinstance(unit, str) and isinstance(count, int | float) and not isinstance(count, bool):
            self.host_items += count
        else:
            with contextlib.suppress(TypeError, ValueError, RuntimeError):  # not a number
                count = torch.as_tensor(count, device=self.items.device)
            if not isinstance(unit, str) or not isinstance(count, torch.Tensor) or count.numel() != 1:
                raise TaskError(
                    f"count_items returned {type(counted).__name__} {str(counted)[:60]!r}; return (unit, count) with "
                    'one number, e.g. ("tokens", mask.sum())'
                )
            self.items += count.to(torch.float64).reshape(())
        self.unit = unit
