"""Exact distributed evaluation of any task: the task's `validation_step` updates its
metrics batch by batch (engine/metrics.py), and each rank sees its own shard of the
validation set, every sample exactly once."""

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from engine.batch import move_to_device
from engine.distributed import all_reduce_max
from engine.metrics import compute_metrics
from engine.optim import autocast


@torch.no_grad()
def evaluate(model: nn.Module, loader, validation_step, metrics: dict, device: torch.device, precision: str) -> dict:
    """{"val_<name>": value, ..., "num_samples": n} over the whole validation set, the
    same on every rank. Every rank must call this.

    Pass the unwrapped model: DDP's forward may broadcast buffers, a collective that
    would hang when ranks hold shards of different lengths. An FSDP model's forward is a
    collective itself, so there every rank runs as many forwards as the busiest one (the
    extra ones on the set's first sample, into metrics that are thrown away).
    """
    model.eval()
    spare_metrics = copy.deepcopy(metrics)  # still empty: the FSDP padding's throwaway
    for batch in loader:
        with autocast(precision, device):
            validation_step(model, move_to_device(batch, device), metrics)
    if isinstance(model, FSDPModule):
        spare_batch = move_to_device(loader.collate_fn([loader.dataset[0]]), device)
        for _ in range(all_reduce_max(len(loader), device) - len(loader)):
            with autocast(precision, device):
                validation_step(model, spare_batch, spare_metrics)
    return compute_metrics(metrics, loader.sampler.yielded, device)
