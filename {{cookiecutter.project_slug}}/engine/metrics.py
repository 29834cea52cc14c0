"""Validation metrics that are exact on any number of processes: every validation sample
counts once, also when the ranks' shards differ in length.

Two kinds, for model.py's `build_metrics(cfg)` and `validation_step(model, batch, metrics)`:
- `Sum` and `Mean`: running sums on the device (float64), all-reduced once per
  evaluation: accuracy, mean loss, MSE, token-weighted loss, a confusion matrix for IoU.
- `Gathered`: per-sample results kept on each rank, gathered on rank 0 in dataset order
  and computed there once: metrics that are not sums (AUROC, COCO mAP, a median).

Each metric's result appears as `val_<name>`; a metric whose `compute` returns a dict
appears as `val_<key>` for each of its keys.
"""

from collections.abc import Callable

import numpy as np
import torch

from engine.batch import map_leaves
from engine.config import UsageError
from engine.distributed import all_reduce_sum, broadcast_from_main, gather_objects_on_main, get_world_size, is_main


class Sum:
    """A sum over the validation set of a tensor of fixed `shape` (e.g. a confusion matrix
    of shape (C, C)); the result is `compute(total)` (default: the total as a number)."""

    def __init__(self, shape=(), compute: Callable | None = None):
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.compute_total = compute or float

    def update(self, value: torch.Tensor) -> None:
        """Add this batch's sum (no host sync: it stays on the device)."""
        if self.total.device != value.device:
            self.total = self.total.to(value.device)
        self.total += value.detach()


class Mean(Sum):
    """The mean over the validation set of per-sample values: `update(values)` with one
    value per sample (1.0/0.0 for accuracy, a loss with reduction="none"), or
    `update(total, count=n)` for a sum over n items (e.g. tokens)."""

    def __init__(self):
        super().__init__(shape=(2,), compute=lambda total: (total[0] / total[1].clamp(min=1)).item())

    def update(self, values: torch.Tensor, count=None) -> None:
        values = values.detach()
        count = values.numel() if count is None else count
        total = values.sum(dtype=torch.float64)
        super().update(torch.stack([total, torch.as_tensor(count, dtype=torch.float64, device=total.device)]))


class Gathered:
    """A metric computed once from every sample's result: `update(*columns)` with one
    row per sample of the batch in each column (a tensor whose first dimension is the
    batch, or a list with one item per sample, e.g. a detector's dicts). Rank 0 gathers
    the rows of every rank in dataset order and calls `compute(*columns)`: tensors for
    tensor columns, lists for list columns. The order, and so the result, is the same on
    any number of processes."""

    def __init__(self, compute: Callable):
        self.compute_rows = compute
        self.chunks: list[tuple] = []  # one tuple of columns per batch, on the CPU as numpy

    def update(self, *columns) -> None:
        self.chunks.append(tuple(map_leaves(column, to_numpy, is_tensor) for column in columns))

    def local_rows(self) -> list:
        """This rank's rows, column by column: arrays (tensor columns) or lists."""
        if not self.chunks:
            return []
        return [join(parts) for parts in zip(*self.chunks, strict=True)]


def is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Numpy arrays travel between processes without pickled tensors (which torch loads
    with weights_only=False)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def join(parts: list):
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [row for part in parts for row in part]


def interleave(per_rank: list, world_size: int):
    """Rows in dataset order: rank r's k-th row is sample r + k * world_size (the
    validation ShardSampler's layout)."""
    total = sum(len(rows) for rows in per_rank)
    if isinstance(per_rank[0], np.ndarray):
        out = np.empty((total, *per_rank[0].shape[1:]), dtype=per_rank[0].dtype)
    else:
        out = [None] * total
    for rank, rows in enumerate(per_rank):
        out[rank::world_size] = rows
    return out


def compute_metrics(metrics: dict, num_samples: int, device: torch.device) -> dict:
    """Every metric's result, the same on every rank, and `num_samples` summed over the
    ranks. Every rank must call this."""
    for name, metric in metrics.items():
        if not isinstance(metric, (Sum, Gathered)):
            raise UsageError(
                f"metric {name!r} is a {type(metric).__name__}; build_metrics must return engine.metrics "
                "Mean, Sum or Gathered objects (wrap a library's function in Gathered(compute=...))"
            )
    sums = {name: m for name, m in metrics.items() if isinstance(m, Sum)}
    flat = [m.total.to(device).flatten() for m in sums.values()]
    reduced = all_reduce_sum(torch.cat([*flat, torch.tensor([float(num_samples)], device=device, dtype=torch.float64)]))
    results, offset = {}, 0
    for name, metric in sums.items():
        size = metric.total.numel()
        results[name] = metric.compute_total(reduced[offset : offset + size].reshape(metric.total.shape).cpu())
        offset += size
    results = flatten_results(results)
    gathered = {name: m for name, m in metrics.items() if isinstance(m, Gathered)}
    if gathered:
        results |= compute_gathered(gathered, num_samples)
    return {**results, "num_samples": int(reduced[-1].item())}


def compute_gathered(metrics: dict[str, "Gathered"], num_samples: int) -> dict:
    """Gather each Gathered metric's rows on rank 0, compute there, share the results."""
    everything = gather_objects_on_main({"samples": num_samples, **{n: m.local_rows() for n, m in metrics.items()}})
    results = None
    if is_main():
        results = {}
        samples = [part["samples"] for part in everything]
        for name, metric in metrics.items():
            columns = []
            for rank_rows in zip(*with_empty_ranks([part[name] for part in everything]), strict=True):
                check_one_row_per_sample(name, rank_rows, samples)
                rows = interleave(list(rank_rows), get_world_size())
                columns.append(map_leaves(rows, torch.from_numpy, lambda v: isinstance(v, np.ndarray)))
            results[name] = metric.compute_rows(*columns)
    return broadcast_from_main(flatten_results(results) if results is not None else None)


def with_empty_ranks(per_rank: list[list]) -> list[list]:
    """Ranks whose shard was empty sent no columns: give them empty ones of the same kind."""
    model = next((columns for columns in per_rank if columns), [])
    empty = [column[:0] for column in model]
    return [columns or empty for columns in per_rank]


def check_one_row_per_sample(name: str, rank_rows: tuple, samples: list[int]) -> None:
    for rank, (rows, expected) in enumerate(zip(rank_rows, samples, strict=True)):
        if len(rows) != expected:
            raise UsageError(
                f"metric {name!r}: rank {rank} gave {len(rows)} rows for {expected} samples; call "
                "Gathered.update with one row per sample of the batch"
            )


def flatten_results(results: dict) -> dict:
    """{name: number} as {"val_<name>": float}; a dict result gives "val_<key>" per key."""
    flat = {}
    for name, value in results.items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for key, number in items:
            flat[f"val_{key}"] = float(number)
    return flat
