"""A run whose gradients become NaN or infinite has diverged: it must stop, with its last
good checkpoint intact, instead of training on and saving non-finite weights as progress.

Every optimizer step keeps its gradient norm, a tensor on the device: nothing waits for
it and the guard adds no op to the step{% if cookiecutter.fsdp %} (under FSDP the norm's shards are still summed
at every step, on every rank alike){% endif %}. Every FOLD_EVERY steps, and at each check, the
kept norms are reduced on the device to the first non-finite step. Every
train.log_every_steps steps, `check_later` starts copying that to the host and reads the
copy it started the time before: no wait for the device (on a GPU, draining its queue
would idle it). Before every checkpoint, `check` reads it at once (a host sync), so
nothing non-finite is saved.
The gradients are all-reduced before the norm is taken, so every rank sees the same
norm and decides alike.

With fp16 the GradScaler skips steps with non-finite gradients itself and lowers its
scale: that is normal. Such a run has diverged only when the scale has collapsed, i.e.
no scale makes the gradients finite.
"""

from collections.abc import Callable

import torch
{% if cookiecutter.fsdp %}from torch.distributed.tensor import DTensor
{% endif %}
from engine.config import TrainConfig
from engine.distributed import all_reduce_max_
from engine.errors import DivergedError

MIN_FP16_SCALE = 2.0**-10  # 26 halvings below GradScaler's initial 2**16
FOLD_EVERY = 100  # norms kept before they are reduced: a few ops per 100 steps, not 5 per step


class NonFiniteGuard:
    def __init__(self, train: TrainConfig, last_good: Callable[[], str], lr: float, device: torch.device):
        """`last_good()` says which checkpoint the run leaves behind (the checkpointer's)."""
        self.max_bad_steps, self.last_good, self.lr = train.max_bad_steps, last_good, lr
        self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.norms: list[torch.Tensor] = []  # of consecutive steps, from `self.norms_from`
        self.norms_from = 0
        self.skipped_steps = 0  # over the whole run: saved in checkpoints
        self.first_bad_later = LaggedValue()  # what `check_later` started reading

    def skip_step(self, grad_norm: torch.Tensor, step: int) -> bool:
        """Record step `step`'s gradient norm; whether to skip its update. Skipping needs
        the norm on the host at every step, so it is on only with train.max_bad_steps > 0."""
{%- if cookiecutter.fsdp %}
        if isinstance(grad_norm, DTensor):  # FSDP: the norm over every shard
            grad_norm = grad_norm.full_tensor()
{%- endif %}
        if self.max_bad_steps == 0:
            self.keep(grad_norm, step)
            return False
        if bool(torch.isfinite(grad_norm)):
            return False
        self.skipped_steps += 1
        if self.skipped_steps > self.max_bad_steps:
            skipped = f"after {self.max_bad_steps} skipped (train.max_bad_steps)"
            raise DivergedError(self.message(f"at step {step}, {skipped}"))
        return True

    def keep(self, grad_norm: torch.Tensor, step: int) -> None:
        if self.norms and step != self.norms_from + len(self.norms):
            self.fold()  # fold counts steps from norms_from: it needs them consecutive
        if not self.norms:
            self.norms_from = step
        self.norms.append(grad_norm)
        if len(self.norms) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Reduce the kept norms into `first_bad_step`, on the device (no host sync)."""
        if not self.norms:
            return
        bad = ~torch.isfinite(torch.stack(self.norms))
        first_here = self.norms_from + (bad.cumsum(0) == 0).sum()  # steps before the first bad one
        first = self.first_bad_step
        self.first_bad_step = torch.where(bad.any() & (first < 0), first_here, first)
        self.norms = []

    def check_later(self) -> None:
        """Stop every rank together if a step before the previous call had non-finite
        gradients; this call's steps are read at the next call (or by `check`). Nothing
        waits for the device. Every rank must call this at the same steps."""
        self.fold()
        first_bad = self.first_bad_later.swap(all_reduce_max_(self.first_bad_step.clone()))
        if first_bad is not None and first_bad >= 0:
            raise DivergedError(self.message(f"at step {first_bad}"))

    def check(self, scaler: torch.amp.GradScaler) -> None:
        """Stop every rank together if a step had non-finite gradients, or fp16's loss
        scale collapsed; waits for the device. Every rank must call this."""
        self.fold()
        first_bad = int(all_reduce_max_(self.first_bad_step.clone()))
        if first_bad >= 0:
            raise DivergedError(self.message(f"at step {first_bad}"))
        if scaler.is_enabled() and scaler.get_scale() < MIN_FP16_SCALE:
            raise DivergedError(self.message(f"at every scale (the fp16 loss scale fell below {MIN_FP16_SCALE:g})"))

    def message(self, where: str) -> str:
        return (
            f"training diverged: non-finite gradients {where}; {self.last_good()}. Try a lower learning rate "
            f"(this run's: {self.lr:.4g}; recipe.py, optim: in config.yaml), a longer warmup, or train.grad_clip; "
            "train.max_bad_steps=N skips up to N such steps"
        )


class LaggedValue:
    """A number on the device, read one call later. `swap(tensor)` starts copying `tensor`
    to the host without waiting, and returns the number the previous call started copying
    (None the first time). By then that copy has long finished, so reading it waits for
    nothing; on the CPU the copy is done at once."""

    def __init__(self):
        self.pending = None  # (host tensor, CUDA event or None)

    def swap(self, tensor: torch.Tensor) -> int | float | None:
        previous = None
        if self.pending is not None:
            host, copied = self.pending
            if copied is not None:
                copied.synchronize()  # the copy of one interval ago: finished long since
            previous = host.item()
        # Pinned memory: a copy from the GPU into pageable memory would wait for it.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        host.copy_(tensor, non_blocking=True)
        copied = None
        if tensor.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self.pending = (host, copied)
        return previous
