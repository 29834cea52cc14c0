"""Validation metrics that are bitwise the same on any number of processes: fixed batches are dealt whole to
ranks (loader.py's EvalBatches) and results combined in batch order, never rank order."""

from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from engine import distributed
from engine.errors import TaskError
from engine.loader import map_leaves, move_to_device
from engine.training import autocast

TOTAL_OR_COUNT = "or update(total, count=n) for a total over n items"


class Metric:
    """`name`: build_metrics' key, for error messages."""

    name, kind = "?", "Metric"

    def check_rows(self, rows: int, samples: int) -> None:
        if rows not in (0, samples):
            raise TaskError(
                f"metric {self.name!r}: {self.kind}.update got {rows} rows for a batch of {samples} samples; "
                f"give one row per sample, {TOTAL_OR_COUNT}"
            )


class Sum(Metric):
    """`compute(total)` of `update(rows)` of [batch, *shape] (e.g. a confusion matrix), or `update(total, count=n)`."""

    kind = "Sum"

    def __init__(self, shape=(), compute: Callable | None = None):
        self.shape = self.row = torch.Size(shape)  # of the total, of one sample's row
        self.compute = compute or float
        self.batch_total, self.rows = None, 0  # of the batch in progress; rows given without count=
        self.batch_totals: list[torch.Tensor] = []  # per batch, flat

    def update(self, values: torch.Tensor, count=None) -> None:
        if not isinstance(values, torch.Tensor):
            raise TaskError(f"metric {self.name!r}: {self.kind}.update needs a tensor, got {type(values).__name__}")
        if count is None and (values.shape[1:] != self.row or values.ndim != len(self.row) + 1):
            raise TaskError(
                f"metric {self.name!r}: {self.kind}.update got shape {list(values.shape)}; give one row per sample "
                f"(shape [{', '.join(['batch', *map(str, self.row)])}]), {TOTAL_OR_COUNT}"
            )
        self.rows += len(values) if count is None else 0
        total = self.total(values.detach(), count)
        self.batch_total = total if self.batch_total is None else self.batch_total + total

    def total(self, values: torch.Tensor, count) -> torch.Tensor:
        if count is None:
            return values.sum(dim=0, dtype=torch.float64)
        if values.shape != self.shape:
            raise TaskError(
                f"metric {self.name!r}: Sum.update(total, count=n) got shape {list(values.shape)}, "
                f"not the Sum's shape {list(self.shape)}"
            )
        return values.to(torch.float64)

    def end_batch(self, samples: int) -> None:
        self.check_rows(self.rows, samples)
        empty = torch.zeros(self.shape.numel(), dtype=torch.float64)
        self.batch_totals.append(empty if self.batch_total is None else self.batch_total.flatten())
        self.batch_total, self.rows = None, 0


class Mean(Sum):
    """The mean of `update(values)` of shape [batch], or of `update(total, count=n)` (a loss over n tokens)."""

    kind = "Mean"

    def __init__(self):
        super().__init__(shape=(2,), compute=lambda total: (total[0] / total[1].clamp(min=1)).item())
        self.row = torch.Size()  # the total is (sum, count)

    def total(self, values: torch.Tensor, count) -> torch.Tensor:
        count = torch.as_tensor(len(values) if count is None else count, dtype=torch.float64, device=values.device)
        return torch.stack([values.sum(dtype=torch.float64), count])


class Gathered(Metric):
    """`compute(*columns)` on rank 0 (AUROC, mAP) of `update(*columns)`: tensors or lists with a row per sample."""

    kind = "Gathered"

    def __init__(self, compute: Callable):
        self.compute = compute
        self.parts: list[tuple] = []  # the batch in progress: columns per update
        self.batches: list[list] = []  # per batch: its columns

    def update(self, *columns) -> None:
        for number, column in enumerate(columns, start=1):
            if isinstance(column, torch.Tensor) and column.ndim == 0 or not hasattr(column, "__len__"):
                raise TaskError(
                    f"metric {self.name!r}: Gathered.update's column {number} is a single value; give one row per "
                    "sample: a tensor whose first dimension is the batch, or a list"
                )
        self.parts.append(tuple(map_leaves(column, kept, torch.is_tensor) for column in columns))

    def end_batch(self, samples: int) -> None:
        self.batches.append([join(parts) for parts in zip(*self.parts, strict=True)])
        for rows in self.batches[-1]:
            self.check_rows(len(rows), samples)
        self.parts = []


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, and copied if a view of a larger tensor (a column of the logits), so the rest is freed."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size() else tensor


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Numpy arrays travel without pickled tensors (which torch loads with weights_only=False)."""
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).cpu().numpy()


def join(parts: list):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [row for part in parts for row in part]


def check_metrics(metrics: dict) -> dict:
    if not isinstance(metrics, dict):
        raise TaskError(f"build_metrics must return a dict of name: metric, not {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TaskError(
                f"metric {name!r} is a {type(metric).__name__}; build_metrics must return engine.metrics "
                "Mean, Sum or Gathered objects (wrap a library's function in Gathered(compute=...))"
            )
        metric.name = name
    return metrics


@torch.no_grad()
def evaluate(model: nn.Module, loader, validation_step, metrics, device, precision, max_batches=None, stop=None):
    """{"val_<name>" or "val_<key>" of a dict: value, ..., "num_samples": n}, the same on every rank; None if
    `stop(batch_round)` said so. Pass the unwrapped model: DDP's forward may broadcast, and batches are uneven.
    Every rank runs as many forwards as rank 0, the extra ones counted nowhere: a sharded model's forward is a
    collective itself."""
    metrics = check_metrics(metrics)
    plan = loader.batch_sampler
    num_batches = plan.num_batches if max_batches is None else min(plan.num_batches, max_batches * plan.world_size)
    mine = plan.mine(num_batches)
    every_rank_has = num_batches // plan.world_size  # rounds at which a stop can be agreed
    model.eval()
    # A validation_step failing on some ranks only would leave the others in a sharded model's all-gather.
    with distributed.stop_all_if_any_fails(device):
        for batch_round, (batch_id, batch) in enumerate(zip(mine, loader, strict=False)):  # a sanity check stops early
            with autocast(precision, device):
                validation_step(model, move_to_device(batch, device), metrics)
            for metric in metrics.values():
                metric.end_batch(plan.samples_in(batch_id))
            if stop is not None and batch_round < every_rank_has and stop(batch_round):
                return None  # every rank, after the same round
        for _ in range(-(-num_batches // plan.world_size) - len(mine)):  # up to rank 0's count, the most
            with autocast(precision, device):  # into a batch never ended, so never counted
                validation_step(model, move_to_device(loader.collate_fn([loader.dataset[0]]), device), metrics)
    return compute_metrics(metrics, plan, num_batches, device)


def compute_metrics(metrics: dict, plan, num_batches: int, device: torch.device) -> dict:
    """Every metric's result over the first `num_batches` batches of `plan`. Every rank must call this."""
    sums = {name: m for name, m in metrics.items() if isinstance(m, Sum)}
    gathered = {name: m for name, m in metrics.items() if isinstance(m, Gathered)}
    results = sum_in_batch_order(sums, plan, num_batches, device) if sums else {}
    results |= compute_gathered(gathered, num_batches) if gathered else {}
    flat = {}
    for name, value in results.items():  # a dict result gives "val_<key>" for each key
        for key, number in value.items() if isinstance(value, dict) else [(name, value)]:
            flat[f"val_{key}"] = float(number)
    return {**flat, "num_samples": sum(plan.samples_in(b) for b in range(num_batches))}


def sum_in_batch_order(sums: dict[str, Sum], plan, num_batches: int, device: torch.device) -> dict:
    """Each Sum's result from its batch totals, added in batch order."""
    table = torch.zeros(num_batches, sum(m.shape.numel() for m in sums.values()), dtype=torch.float64, device=device)
    for row, batch_id in enumerate(plan.mine(num_batches)):
        table[batch_id] = torch.cat([m.batch_totals[row].to(device) for m in sums.values()])
    table = distributed.all_reduce(table).cpu()  # one rank's value plus zeros: exact in any order
    totals = torch.zeros(table.shape[1], dtype=torch.float64)
    for row in table:  # one add per batch, elementwise: the order is fixed whatever the threads
        totals += row
    pieces = totals.split([metric.shape.numel() for metric in sums.values()])
    return {name: m.compute(piece.reshape(m.shape)) for (name, m), piece in zip(sums.items(), pieces, strict=True)}


def compute_gathered(metrics: dict[str, Gathered], num_batches: int) -> dict:
    """Each Gathered metric's result, computed on rank 0 and shared. Every rank must call this."""
    mine = {name: map_leaves(m.batches, to_numpy, torch.is_tensor) for name, m in metrics.items()}  # once to the host
    everything = distributed.gather_objects_on_main(mine)
    results = None
    if distributed.is_main():
        results = {}
        for name, metric in metrics.items():
            # Batch b was evaluated by rank b % N, as its (b // N)-th batch.
            batches = [everything[b % len(everything)][name][b // len(everything)] for b in range(num_batches)]
            columns = [join(parts) for parts in zip(*filter(None, batches), strict=True)]
            results[name] = metric.compute(*map_leaves(columns, torch.from_numpy, lambda v: isinstance(v, np.ndarray)))
    return distributed.broadcast_from_main(results)
