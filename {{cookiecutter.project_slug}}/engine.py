"""The training step loop and exact distributed evaluation."""

import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from config import Config, UsageError
from distributed import PeerFailed, all_reduce_max, all_reduce_sum
from optim import autocast
from parallel import memory_format

FULL = StateDictOptions(full_state_dict=True)
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class TrainState:
    """Everything a checkpoint must hold to continue the run exactly."""

    model: nn.Module  # unwrapped: what is saved and evaluated
    train_model: nn.Module  # what is trained: the DDP wrapper, or the model itself
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    epoch: int = 0  # epoch in progress
    batches_done: int = 0  # micro-batches of `epoch` already trained
    step: int = 0  # optimizer steps taken in the whole run
    best_acc: float = -1.0
    stopped_early: bool = field(default=False, compare=False)

    def state_dict(self) -> dict:
        """Plain full tensors on the CPU, the same for DDP and FSDP (so either resumes the
        other). Every rank must call this: under FSDP it gathers the shards."""
        return {
            "model": get_model_state_dict(self.model, options=FULL_ON_CPU),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL_ON_CPU),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "step": self.step,
            "best_acc": self.best_acc,
        }

    def load_state_dict(self, state: dict) -> None:
        """Optimizer, schedule and position; the model weights are loaded separately."""
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FULL)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch = state["epoch"]
        self.batches_done = state["batches_done"]
        self.step = state["step"]
        self.best_acc = state["best_acc"]


def train_one_epoch(state: TrainState, loader, cfg: Config, device, progress, after_step) -> dict:
    """Train from `state.batches_done` to the end of `state.epoch`, or until
    `after_step(state)` (called after every optimizer step) returns True.

    Gradients of `accum_steps` micro-batches are summed locally (DDP's no_sync skips the
    all-reduce) and averaged across ranks on the last one, so one optimizer step sees the
    mean loss over batch_size * world_size * accum_steps samples.
    """
    state.train_model.train()
    start = time.perf_counter()
    step_ends = [start]  # host clock at each optimizer step: no device sync needed
    layout = memory_format(cfg)
    try:
        loss_sum, batches = train_steps(state, loader, cfg, device, progress, after_step, layout, step_ends)
    except UsageError as error:
        if not isinstance(error, PeerFailed):
            error.local = True  # e.g. an unreadable image: only this rank knows
        raise
    elapsed = time.perf_counter() - start
    totals = all_reduce_sum(torch.stack([loss_sum.double(), torch.tensor(batches, dtype=torch.float64, device=device)]))
    samples = totals[1].item() * cfg.train.batch_size
    step_times = [b - a for a, b in itertools.pairwise(step_ends)]
    return {
        "train_loss": (totals[0] / totals[1].clamp(min=1)).item(),
        "samples_per_s": samples / max(elapsed, 1e-9),
        "step_time_median_s": statistics.median(step_times) if step_times else 0.0,
        "train_time_s": elapsed,
    }


def train_steps(state, loader, cfg, device, progress, after_step, layout, step_ends):
    """The step loop of train_one_epoch; returns (loss sum, micro-batches run)."""
    accum = cfg.train.accum_steps
    loss_sum = torch.zeros((), device=device)  # on the device: no sync per step
    batches = 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=layout)
        labels = labels.to(device, non_blocking=True)
        last_micro_batch = (state.batches_done + 1) % accum == 0
        with gradient_sync(state.train_model, enabled=last_micro_batch):
            with autocast(cfg.train.precision, device):
                loss = F.cross_entropy(state.train_model(images), labels)
            # Mean over the accumulated micro-batches (no extra op when there is one).
            state.scaler.scale(loss / accum if accum > 1 else loss).backward()
        loss_sum += loss.detach()
        state.batches_done += 1
        batches += 1
        if last_micro_batch:
            optimizer_step(state, cfg.train.grad_clip)
            step_ends.append(time.perf_counter())
            progress.step(state.step, loss.detach(), state.scheduler.get_last_lr()[0])
            if after_step(state):
                state.stopped_early = True
                break
    return loss_sum, batches


def gradient_sync(model: nn.Module, enabled: bool):
    """Gradients are averaged across ranks in backward; skip that on micro-batches that
    only accumulate (DDP's no_sync, FSDP's requires_gradient_sync)."""
    if enabled:
        return contextlib.nullcontext()
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if isinstance(model, DDP):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def optimizer_step(state: TrainState, grad_clip: float) -> None:
    if grad_clip > 0:
        state.scaler.unscale_(state.optimizer)  # clip true gradients, not scaled ones
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1


@torch.no_grad()
def evaluate(model: nn.Module, loader, device, precision: str) -> dict:
    """Loss and accuracy over the whole validation set, each sample counted once.

    Pass the unwrapped model: DDP's forward may broadcast buffers, a collective that
    would hang when ranks hold shards of different lengths. An FSDP model's forward is a
    collective itself, so there every rank runs as many forwards as the busiest one
    (the extra ones on a blank input, counted nowhere).
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(precision, device):
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    if isinstance(model, FSDPModule):
        blank = torch.zeros(1, *loader.dataset[0][0].shape, device=device)
        for _ in range(all_reduce_max(len(loader), device) - len(loader)):
            with autocast(precision, device):
                model(blank)
    all_reduce_sum(totals)
    loss_sum, correct, count = totals.tolist()
    count = max(count, 1.0)
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "num_samples": int(totals[2].item())}
