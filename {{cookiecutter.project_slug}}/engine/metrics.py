"""Validation metrics that are bitwise the same on any number of processes, and the
evaluation loop that feeds them.

The validation set is cut into fixed batches in dataset order and whole batches are
dealt to ranks (engine/loader.py's EvalBatches): a batch holds the same samples whatever
the number of processes, so each sample's result has the same bits even where a kernel's
output depends on the batch-mates (GEMM blocking, reductions, recurrent layers).
Results are kept per batch and combined in batch order, never in rank order.

Three kinds, for model.py's `build_metrics(cfg)` and `validation_step(model, batch, metrics)`:
- `Mean`: the mean of one value per sample (`update(values)`, shape [batch]), or of a
  weighted total (`update(total, count=n)`, e.g. a loss summed over n tokens).
- `Sum`: a sum of rows of a fixed `shape` (`update(rows)`, shape [batch, *shape]), or of
  a batch's total (`update(total, count=n)`, shape `shape`), e.g. a confusion matrix;
  the result is `compute(total)`.
- `Gathered`: per-sample rows, gathered on rank 0 in dataset order and computed there
  once: metrics that are not sums (AUROC, COCO mAP, a median).

A batch's sums stay on the device; they travel once, at the end, in one all-reduce of a
small table with a row per batch (each rank fills its own rows, zeros elsewhere). Each
metric's result appears as `val_<name>`; a metric whose `compute` returns a dict
appears as `val_<key>` for each of its keys.
"""

{% if cookiecutter.fsdp %}import copy
{% endif %}from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn
{% if cookiecutter.fsdp %}from torch.distributed.fsdp import FSDPModule
{% endif %}
from engine.distributed import (
    all_reduce_sum,
    broadcast_from_main,
    gather_objects_on_main,
    get_world_size,
    is_main,
    stop_all_if_any_fails,
)
from engine.errors import TaskError
from engine.loader import map_leaves, move_to_device
from engine.training import autocast

TOTAL_OR_COUNT = "or update(total, count=n) for a total over n items"


class Metric:
    """What the evaluation loop needs of every metric; `name` is build_metrics' key."""

    name = "?"

    def end_batch(self, samples: int) -> None:
        """Close the batch just evaluated (it had `samples` samples)."""
        raise NotImplementedError


class Sum(Metric):
    """A sum over the validation set of rows of a fixed `shape` (e.g. (C, C) for a
    confusion matrix); the result is `compute(total)` (default: the total as a number).

    `update(rows)`: one row per sample, shape [batch, *shape], summed here.
    `update(total, count=n)`: a total of `shape` already summed over n items.
    """

    kind = "Sum"

    def __init__(self, shape=(), compute: Callable | None = None):
        self.shape = torch.Size(shape)
        self.compute_total = compute or float
        self.batch_total = None  # of the batch in progress, on the device
        self.rows = 0  # rows given without count= in the batch in progress
        self.batch_totals: list[torch.Tensor | None] = []  # one per batch evaluated

    def update(self, values: torch.Tensor, count=None) -> None:
        values = self.checked_tensor(values)
        if count is None:
            if values.shape[1:] != self.shape or values.ndim != len(self.shape) + 1:
                raise TaskError(self.wrong_shape(values, rows_shape(self.shape)))
            self.rows += values.shape[0]
            total = values.sum(dim=0, dtype=torch.float64)
        elif values.shape != self.shape:
            raise TaskError(
                f"metric {self.name!r}: Sum.update(total, count=n) got shape {list(values.shape)}, "
                f"not the Sum's shape {list(self.shape)}"
            )
        else:
            total = values.to(torch.float64)
        self.add(total)

    def checked_tensor(self, values) -> torch.Tensor:
        if not isinstance(values, torch.Tensor):
            raise TaskError(f"metric {self.name!r}: {self.kind}.update needs a tensor, got {type(values).__name__}")
        return values.detach()

    def wrong_shape(self, values: torch.Tensor, expected: str) -> str:
        return (
            f"metric {self.name!r}: {self.kind}.update got shape {list(values.shape)}; give one row per sample "
            f"(shape {expected}), {TOTAL_OR_COUNT}"
        )

    def add(self, total: torch.Tensor) -> None:
        self.batch_total = total if self.batch_total is None else self.batch_total + total

    def end_batch(self, samples: int) -> None:
        check_rows(self, self.rows, samples)
        self.batch_totals.append(self.batch_total)
        self.batch_total, self.rows = None, 0

    def per_batch(self, device: torch.device) -> torch.Tensor:
        """[batches, numel]: each batch's total, zeros where the batch gave none."""
        empty = torch.zeros(self.shape.numel(), dtype=torch.float64, device=device)
        rows = [empty if t is None else t.to(device).flatten() for t in self.batch_totals]
        return torch.stack(rows) if rows else torch.zeros(0, self.shape.numel(), dtype=torch.float64, device=device)

    def compute(self, total: torch.Tensor):
        return self.compute_total(total.reshape(self.shape))


class Mean(Sum):
    """The mean over the validation set of one value per sample: `update(values)` with
    shape [batch] (1.0/0.0 for accuracy, a loss with reduction="none"), or
    `update(total, count=n)` for a sum over n items (e.g. a loss summed over n tokens;
    `count` may be a number or a tensor)."""

    kind = "Mean"

    def __init__(self):
        super().__init__(shape=(2,), compute=lambda total: (total[0] / total[1].clamp(min=1)).item())

    def update(self, values: torch.Tensor, count=None) -> None:
        values = self.checked_tensor(values)
        if count is None:
            if values.ndim != 1:
                raise TaskError(self.wrong_shape(values, "[batch]"))
            self.rows += values.shape[0]
            count = values.shape[0]
        total = values.sum(dtype=torch.float64)
        self.add(torch.stack([total, torch.as_tensor(count, dtype=torch.float64, device=total.device)]))


class Gathered(Metric):
    """A metric computed once from every sample's result: `update(*columns)` with one
    row per sample of the batch in each column (a tensor whose first dimension is the
    batch, or a list with one item per sample, e.g. a detector's dicts). Rank 0 gathers
    the rows of every rank in dataset order and calls `compute(*columns)`: tensors for
    tensor columns, lists for list columns, the same on any number of processes."""

    kind = "Gathered"

    def __init__(self, compute: Callable):
        self.compute_rows = compute
        self.parts: list[tuple] = []  # the batch in progress: one tuple of columns per update
        self.batches: list[tuple | None] = []  # per batch evaluated: its columns (on the device)

    def update(self, *columns) -> None:
        for number, column in enumerate(columns, start=1):
            if isinstance(column, torch.Tensor) and column.ndim == 0 or not hasattr(column, "__len__"):
                raise TaskError(
                    f"metric {self.name!r}: Gathered.update's column {number} is a single value; give one row per "
                    "sample: a tensor whose first dimension is the batch, or a list"
                )
        self.parts.append(tuple(map_leaves(column, kept, is_tensor) for column in columns))

    def end_batch(self, samples: int) -> None:
        columns = [join(parts) for parts in zip(*self.parts, strict=True)] if self.parts else None
        if columns is not None:
            for rows in columns:
                check_rows(self, len(rows), samples)
        self.batches.append(columns)
        self.parts = []

    def local_batches(self) -> list:
        """This rank's batches as numpy (one copy to the host, at the end)."""
        return [None if b is None else map_leaves(b, to_numpy, is_tensor) for b in self.batches]


def rows_shape(shape: torch.Size) -> str:
    return "[" + ", ".join(["batch", *map(str, shape)]) + "]"


def check_rows(metric: Metric, rows: int, samples: int) -> None:
    if rows not in (0, samples):
        raise TaskError(
            f"metric {metric.name!r}: {metric.kind}.update got {rows} rows for a batch of {samples} samples; "
            f"give one row per sample, {TOTAL_OR_COUNT}"
        )


def is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """A row kept until the end of evaluation: detached, and copied when it is a view of
    a larger tensor (e.g. one column of the logits), so the rest is freed."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Numpy arrays travel between processes without pickled tensors (which torch loads
    with weights_only=False)."""
    tensor = tensor.cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def join(parts: list):
    if isinstance(parts[0], (torch.Tensor, np.ndarray)):
        return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)
    return [row for part in parts for row in part]


def check_metrics(metrics: dict) -> dict:
    """build_metrics' result, each metric told its name (for its error messages)."""
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
def evaluate(
    model: nn.Module, loader, validation_step, metrics: dict, device, precision: str, max_batches=None, stop=None
):
    """{"val_<name>": value, ..., "num_samples": n} over the validation set (or over each
    rank's first `max_batches` batches), the same on every rank. Every rank must call this.
    None if `stop(batch_round)` (StopRequest.during_evaluation) said so after some round.

    Pass the unwrapped model: DDP's forward may broadcast buffers, a collective that
    would hang when ranks hold different numbers of batches.{% if cookiecutter.fsdp %} An FSDP model's forward is a
    collective itself, so there every rank runs as many forwards as rank 0 (the busiest),
    the extra ones on the set's first sample, into metrics that are thrown away.{% endif %}
    """
    metrics = check_metrics(metrics)
    plan = loader.batch_sampler
{%- if cookiecutter.fsdp %}
    spare_metrics = copy.deepcopy(metrics)  # still empty: the FSDP padding's throwaway
{%- endif %}
    num_batches = plan.num_batches if max_batches is None else min(plan.num_batches, max_batches * plan.world_size)
    mine = plan.mine(num_batches)
    every_rank_has = num_batches // plan.world_size  # rounds at which a stop can be agreed
    stopped = False
    model.eval()
{%- if cookiecutter.fsdp %}
    # A failing validation_step stops every rank, none is left waiting (under FSDP only
    # if it fails on every rank alike: the others wait in a forward's all-gather).
{%- else %}
    # A failing validation_step stops every rank, none is left waiting.
{%- endif %}
    with stop_all_if_any_fails(device):
        for batch_round, (batch_id, batch) in enumerate(zip(mine, loader, strict=False)):  # a sanity check stops early
            with autocast(precision, device):
                validation_step(model, move_to_device(batch, device), metrics)
            for metric in metrics.values():
                metric.end_batch(plan.samples_in(batch_id))
            if stop is not None and batch_round < every_rank_has and stop(batch_round):
                stopped = True  # every rank, after the same round
                break
{%- if cookiecutter.fsdp %}
        if isinstance(model, FSDPModule) and not stopped:
            spare_batch = move_to_device(loader.collate_fn([loader.dataset[0]]), device)
            for _ in range(plan.most_per_rank(num_batches) - len(mine)):
                with autocast(precision, device):
                    validation_step(model, spare_batch, spare_metrics)
{%- endif %}
    return None if stopped else compute_metrics(metrics, plan, num_batches, device)


def compute_metrics(metrics: dict, plan, num_batches: int, device: torch.device) -> dict:
    """Every metric's result over the first `num_batches` batches of `plan`, the same on
    every rank, and their number of samples. Every rank must call this."""
    sums = {name: m for name, m in metrics.items() if isinstance(m, Sum)}
    mine = plan.mine(num_batches)
    samples = torch.tensor([[plan.samples_in(b)] for b in mine], dtype=torch.float64, device=device)
    local = torch.cat([*(m.per_batch(device) for m in sums.values()), samples.reshape(len(mine), 1)], dim=1)
    totals = sum_in_batch_order(local, plan.rank, num_batches)
    results, offset = {}, 0
    for name, metric in sums.items():
        size = metric.shape.numel()
        results[name] = metric.compute(totals[offset : offset + size])
        offset += size
    results = flatten_results(results)
    gathered = {name: m for name, m in metrics.items() if isinstance(m, Gathered)}
    if gathered:
        results |= compute_gathered(gathered, num_batches)
    return {**results, "num_samples": int(totals[-1])}


def sum_in_batch_order(local: torch.Tensor, rank: int, num_batches: int) -> torch.Tensor:
    """The column sums of every rank's per-batch rows, added one batch after another in
    batch order: the same bits on any number of processes. `local` holds this rank's
    batches rank, rank + N, ... of the first `num_batches`."""
    table = torch.zeros(num_batches, local.shape[1], dtype=local.dtype, device=local.device)
    table[rank :: get_world_size()] = local
    # Each entry is one rank's value plus zeros from the others: exact in any order.
    table = all_reduce_sum(table).cpu()  # row b: batch b
    total = torch.zeros(local.shape[1], dtype=torch.float64)
    for row in table:  # one add per batch, elementwise: the order is fixed whatever the threads
        total += row
    return total


def compute_gathered(metrics: dict[str, Gathered], num_batches: int) -> dict:
    """Gather each Gathered metric's batches on rank 0, compute there in dataset order,
    share the results. Every rank must call this."""
    everything = gather_objects_on_main({name: m.local_batches() for name, m in metrics.items()})
    results = None
    if is_main():
        world_size, results = len(everything), {}
        for name, metric in metrics.items():
            # Batch b was evaluated by rank b % N, as its (b // N)-th batch.
            batches = [everything[b % world_size][name][b // world_size] for b in range(num_batches)]
            batches = [b for b in batches if b is not None]
            columns = [join(parts) for parts in zip(*batches, strict=True)] if batches else []
            columns = map_leaves(columns, torch.from_numpy, lambda v: isinstance(v, np.ndarray))
            results[name] = metric.compute_rows(*columns)
        results = flatten_results(results)
    return broadcast_from_main(results)


def flatten_results(results: dict) -> dict:
    """{name: number} as {"val_<name>": float}; a dict result gives "val_<key>" per key."""
    flat = {}
    for name, value in results.items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for key, number in items:
            flat[f"val_{key}"] = float(number)
    return flat
