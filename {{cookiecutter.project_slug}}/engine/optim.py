"""Optimizer and learning-rate schedule, chosen by config.

train.lr is the rate for an effective batch of train.reference_batch samples. A run
with another effective batch (batch_size x processes x accum_steps) scales it: linearly
for SGD (Goyal et al. 2017, "Accurate, Large Minibatch SGD"), by the square root for
AdamW, whose steps are normalised per coordinate (Malladi et al. 2022, "On the SDEs and
Scaling Rules for Adaptive Gradient Algorithms"). A warmup over train.warmup_epochs
starts every run gently, which large scaled rates need. So one config trains alike on 1
or 64 processes.

The schedule advances once per optimizer step (not per micro-batch, not per epoch), and
warmup and decay are set in epochs, so the curve over the epochs is the same whatever
the world size or accumulation.
"""

import math

import torch
import torch.nn as nn

from engine.config import TrainConfig, effective_batch
from engine.freezing import trains_later

# Below this many steps per epoch, the effective batch is a large share of the data: the
# scaled lr has too few updates to work with (seen here: 2 steps per epoch diverge).
FEW_STEPS = 8


def scaled_lr(cfg: TrainConfig, world_size: int) -> float:
    """The run's base learning rate: train.lr scaled from reference_batch to the effective batch."""
    if not cfg.scale_lr:
        return cfg.lr
    ratio = effective_batch(cfg, world_size) / cfg.reference_batch
    return cfg.lr * (ratio if cfg.optimizer == "sgd" else math.sqrt(ratio))


def describe_lr(cfg: TrainConfig, world_size: int, steps_per_epoch: int) -> str:
    """How the run's lr came about, for its opening log line."""
    lr = f"lr {scaled_lr(cfg, world_size):.4g}"
    if cfg.scale_lr:
        batch = f"{cfg.batch_size}x{world_size}x{cfg.accum_steps}"
        rule = "linear" if cfg.optimizer == "sgd" else "square-root"
        lr += (
            f" = train.lr {cfg.lr:g} scaled from batch {cfg.reference_batch} to {batch} "
            f"({rule} rule; train.scale_lr=false takes train.lr as is)"
        )
    line = f"{lr}, warmup {warmup_steps(cfg, steps_per_epoch)} steps, {cfg.schedule} schedule"
    if steps_per_epoch < FEW_STEPS:
        line += f"; only {steps_per_epoch} steps per epoch: a smaller effective batch or more epochs train better"
    return line


def build_optimizer(model: nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    """Two parameter groups (with and without weight decay); with train.freeze_epochs,
    up to two more (marked "unfrozen_later") for the parameters trained from then on,
    which the schedule warms up again."""
    # Frozen parameters are left out, unless train.freeze_epochs unfreezes them later.
    now = [p for name, p in model.named_parameters() if p.requires_grad and not trains_later(name, cfg)]
    later = [p for name, p in model.named_parameters() if trains_later(name, cfg)]
    groups = []
    for params, unfrozen_later in ((now, False), (later, True)):
        # No weight decay on biases and norm weights (1-D tensors): decaying them only hurts.
        for decayed in (True, False):
            chosen = [p for p in params if (p.ndim > 1) == decayed]
            if chosen or not unfrozen_later:  # torch's loader takes at most one empty group
                weight_decay = cfg.weight_decay if decayed else 0.0
                groups.append({"params": chosen, "weight_decay": weight_decay, "unfrozen_later": unfrozen_later})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=lr)


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    return round(cfg.warmup_epochs * steps_per_epoch)


def lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: int) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "step":
        return cfg.step_gamma ** (step // (cfg.step_every_epochs * steps_per_epoch))
    total = max(1, cfg.epochs * steps_per_epoch - warmup)
    progress = min(1.0, (step - warmup) / total)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def unfrozen_lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: int) -> float:
    """For parameters frozen for train.freeze_epochs: the schedule, with a warmup over
    train.warmup_epochs again from the unfreeze (a full lr at once can throw the model off)."""
    since = step - cfg.freeze_epochs * steps_per_epoch
    warmup = warmup_steps(cfg, steps_per_epoch)
    ramp = 0.0 if since < 0 else min(1.0, (since + 1) / warmup) if warmup else 1.0
    return ramp * lr_factor(step, cfg, steps_per_epoch)


def build_scheduler(optimizer, cfg: TrainConfig, steps_per_epoch: int):
    def factor(step: int) -> float:
        return lr_factor(step, cfg, steps_per_epoch)

    def unfrozen_factor(step: int) -> float:
        return unfrozen_lr_factor(step, cfg, steps_per_epoch)

    groups = optimizer.param_groups  # build_optimizer's, which mark the parameters frozen for a while
    factors = [unfrozen_factor if group.get("unfrozen_later") else factor for group in groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
