"""Optimizer, learning-rate schedule and mixed precision, all chosen by config.

The schedule advances once per optimizer step (not per micro-batch, not per epoch), so
it follows the same curve whatever the world size or accumulation.
"""

import contextlib
import math

import torch
import torch.nn as nn

from engine.config import Config, ConfigError, TrainConfig

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on biases and norm weights (1-D tensors): decaying them only hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def lr_factor(step: int, cfg: TrainConfig, steps_per_epoch: int) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "step":
        return cfg.step_gamma ** (step // (cfg.step_every_epochs * steps_per_epoch))
    total = max(1, cfg.epochs * steps_per_epoch - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / total)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, cfg: TrainConfig, steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, steps_per_epoch))


def check_precision(cfg: Config, device: torch.device) -> None:
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")


def autocast(precision: str, device: torch.device):
    """A context for forward passes: autocast for bf16/fp16, a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[precision])


def build_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    # fp16 gradients underflow without loss scaling; bf16 and fp32 do not need it. A
    # disabled scaler passes everything through unchanged, so the loop has one shape.
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
