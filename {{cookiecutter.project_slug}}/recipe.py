"""How the model is optimized: the optimizer and the learning-rate schedule. Yours to change.

The run calls `build_optimizer` once and `build_scheduler` once, and then only
`optimizer.step()` (through the GradScaler), `optimizer.zero_grad()`, `scheduler.step()`
once per optimizer step, and their `state_dict()`s. So any `torch.optim.Optimizer` and any
scheduler work here: mixed precision, accumulation, clipping, checkpoints, bitwise resume
and sharding go on working. Settings go in `OptimConfig` (config.yaml's `optim:` section).

What the run tells the recipe: `joins_later` maps the names of parameters that are frozen
now but trained from a later optimizer step (freeze.epochs, a part's setting) to that
step; it is empty when no part freezes any. Put them in the optimizer now (without a
gradient it skips them), or they are never trained. The default puts them in groups of
their own whose warmup starts again at that step.

The default recipe: optim.lr is the rate for an effective batch of optim.reference_batch
samples; a run with another effective batch (batch_size x processes x accum_steps) scales
it, linearly for SGD (Goyal et al. 2017), by the square root for AdamW, whose steps are
normalised per coordinate (Malladi et al. 2022). A warmup over optim.warmup_epochs starts
every run gently, which large scaled rates need. The schedule advances once per optimizer
step, with warmup and decay in epochs, so the curve over the epochs is the same whatever
the world size or accumulation; a run counted in steps (train.max_steps) decays over its
steps, and a stream, which has no epochs, warms up over optim.warmup_steps.
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from engine import ConfigError, check_at_most, check_positive, effective_batch

# Below this many steps per epoch, the effective batch is a large share of the data: the
# scaled lr has too few updates to work with (seen here: 2 steps per epoch diverge).
FEW_STEPS = 8


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.2  # for an effective batch of reference_batch; scaled to the run's (scale_lr)
    scale_lr: bool = True  # scale lr with the effective batch (sgd: linear, adamw: square root); false: as is
    reference_batch: int = 128  # the effective batch that optim.lr is meant for
    momentum: float = 0.9  # sgd only
    weight_decay: float = 5e-4  # not applied to biases and norm weights (1-D parameters)
    schedule: Literal["cosine", "step", "constant"] = "cosine"  # advanced per optimizer step
    warmup_epochs: float = 1.0  # lr rises linearly from near 0 over this many epochs: a steady start
    warmup_steps: int | None = None  # the warmup in optimizer steps instead (a stream has no epochs)
    step_every_epochs: int = 30  # step schedule: multiply lr by step_gamma this often
    step_gamma: float = 0.1  # step schedule only

    def __post_init__(self):
        for key in ("lr", "reference_batch", "step_every_epochs", "step_gamma"):
            check_positive(f"optim.{key}", getattr(self, key))
        for key in ("momentum", "weight_decay", "warmup_epochs"):
            check_positive(f"optim.{key}", getattr(self, key), allow_zero=True)
        check_at_most("optim.warmup_epochs", self.warmup_epochs, 10**6)
        if self.warmup_steps is not None:
            check_positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)


def build_optimizer(model: nn.Module, cfg, world_size: int, joins_later: dict[str, int]) -> torch.optim.Optimizer:
    """Parameter groups with and without weight decay, for the parameters trained from the
    start and, apart, for each step at which frozen ones join (marked "first_step")."""
    first_steps = {name: 0 for name, p in model.named_parameters() if p.requires_grad} | joins_later
    groups = []
    for first_step in sorted(set(first_steps.values()) | {0}):
        params = [p for name, p in model.named_parameters() if first_steps.get(name) == first_step]
        # No weight decay on biases and norm weights (1-D tensors): decaying them only hurts.
        for decayed in (True, False):
            chosen = [p for p in params if (p.ndim > 1) == decayed]
            if chosen or first_step == 0:  # torch's loader takes at most one empty group
                weight_decay = cfg.optim.weight_decay if decayed else 0.0
                groups.append({"params": chosen, "weight_decay": weight_decay, "first_step": first_step})
    lr = scaled_lr(cfg, world_size)
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum)
    return torch.optim.AdamW(groups, lr=lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, steps_per_epoch: int | None):
    """Each group's lr: base lr x lr_factor, from the group's first step. `steps_per_epoch`
    is None for a stream."""
    check_stream_settings(cfg, steps_per_epoch)

    def factor_from(first_step: int):
        return lambda step: lr_factor(step, cfg, steps_per_epoch, first_step)

    factors = [factor_from(group.get("first_step", 0)) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def scaled_lr(cfg, world_size: int) -> float:
    """The run's base learning rate: optim.lr scaled from reference_batch to the effective batch."""
    optim = cfg.optim
    if not optim.scale_lr:
        return optim.lr
    ratio = effective_batch(cfg.train, world_size) / optim.reference_batch
    return optim.lr * (ratio if optim.name == "sgd" else math.sqrt(ratio))


def check_stream_settings(cfg, steps_per_epoch: int | None) -> None:
    """A stream's epochs have no length known ahead: the schedule must not count in them."""
    if steps_per_epoch is not None:
        return
    if cfg.optim.warmup_steps is None:
        raise ConfigError("the training set is a stream, whose epochs have no known length; set optim.warmup_steps")
    if cfg.optim.schedule == "step":
        raise ConfigError("optim.schedule=step counts epochs, which a stream has no length for; use cosine or constant")


def warmup_steps(optim: OptimConfig, steps_per_epoch: int | None) -> int:
    if optim.warmup_steps is not None:
        return optim.warmup_steps
    return round(optim.warmup_epochs * steps_per_epoch)


def total_steps(cfg, steps_per_epoch: int | None) -> int:
    """The run's length in optimizer steps: train.max_steps, else its epochs'."""
    return cfg.train.max_steps or cfg.train.epochs * steps_per_epoch


def lr_factor(step: int, cfg, steps_per_epoch: int, first_step: int = 0) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based): a linear warmup, then the
    schedule. Parameters trained from `first_step` warm up again from there (a full lr at
    once can throw the model off)."""
    optim = cfg.optim
    warmup = warmup_steps(optim, steps_per_epoch)
    if step < warmup:
        factor = (step + 1) / warmup
    elif optim.schedule == "constant":
        factor = 1.0
    elif optim.schedule == "step":
        factor = optim.step_gamma ** (step // (optim.step_every_epochs * steps_per_epoch))
    else:
        total = max(1, total_steps(cfg, steps_per_epoch) - warmup)
        factor = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / total)))
    if first_step:
        since = step - first_step
        factor *= 0.0 if since < 0 else min(1.0, (since + 1) / warmup) if warmup else 1.0
    return factor


def describe(cfg, world_size: int, steps_per_epoch: int | None) -> str:
    """How the run's lr came about, for its opening log line."""
    optim = cfg.optim
    lr = f"lr {scaled_lr(cfg, world_size):.4g}"
    if optim.scale_lr:
        batch = f"{cfg.train.batch_size}x{world_size}x{cfg.train.accum_steps}"
        rule = "linear" if optim.name == "sgd" else "square-root"
        lr += (
            f" = optim.lr {optim.lr:g} scaled from batch {optim.reference_batch} to {batch} "
            f"({rule} rule; optim.scale_lr=false takes optim.lr as is)"
        )
    warmup = warmup_steps(optim, steps_per_epoch)
    rise = f"warmup {warmup} steps (linear from lr/{warmup})" if warmup else "no warmup"
    line = f"{lr}; set at every optimizer step: {rise}, then the {optim.schedule} schedule"
    if steps_per_epoch is not None and steps_per_epoch < FEW_STEPS:
        line += f"; only {steps_per_epoch} steps per epoch: a smaller effective batch or more epochs train better"
    return line
