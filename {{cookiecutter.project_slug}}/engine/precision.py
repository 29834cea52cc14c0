"""Mixed precision: which dtype the forward passes run in, and the fp16 loss scaler.

train.precision is fp32, bf16 or fp16. bf16 and fp16 run the forward passes under
autocast; fp16 also scales the loss (GradScaler), since its gradients underflow.
"""

import contextlib

import torch

from engine.config import Config
from engine.errors import ConfigError

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
