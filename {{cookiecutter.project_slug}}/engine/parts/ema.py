"""An exponential moving average (EMA) of the model's weights (ema:), evaluated beside them
(ema_val_*), saved in checkpoints, and evaluated alone by evaluate.py --weights ema.

At every ema.every_steps-th optimizer step of each epoch (its 1st, 1 + every_steps-th, ...):
ema = decay x ema + (1 - decay) x weights. Until the first such update after ema.start_step
(or ema.warmup_epochs) an update copies the weights instead: the arithmetic of torchvision's
recipe, whose AveragedModel copies while it holds no average and is reset through the lr's
warmup epochs (tests/test_ema.py checks it against AveragedModel), and whose decay ema.adjust
gives. It covers the model's state dict (integer buffers copied), sharded like the model under
FSDP (the fsdp part); `swapped_into_model()` exchanges it with the weights in place, exactly,
so the same model evaluates either.
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine.checkpoint import has_part, load_weights
from engine.config import check_at_most, check_positive, effective_batch, shown
from engine.distributed import is_main
from engine.errors import ConfigError
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {f"train.ema_{key}": f"ema.{key}" for key in ("decay", "start_step")}  # 0.5.0's keys


@dataclass
class Section:
    decay: float = 0.0  # an average of the weights, evaluated beside them (e.g. 0.999); 0 = off
    start_step: int = 0  # through the first update after this optimizer step, an update copies the weights
    warmup_epochs: float = 0.0  # the same in epochs (e.g. the lr's warmup): the later of the two counts
    every_steps: int = 1  # average every this many optimizer steps (torchvision's recipe: 32)
    adjust: bool = False  # true: decay as torchvision's recipe gives it, for its batch per step and epochs

    def __post_init__(self):
        check_positive("ema.decay", self.decay, allow_zero=True)
        check_positive("ema.start_step", self.start_step, allow_zero=True)
        check_positive("ema.warmup_epochs", self.warmup_epochs, allow_zero=True)
        check_at_most("ema.warmup_epochs", self.warmup_epochs, 10**6)  # as optim.warmup_epochs: ceil() of it holds
        check_positive("ema.every_steps", self.every_steps)
        if self.decay >= 1:
            raise ConfigError(f"ema.decay must be below 1 (e.g. 0.999), got {shown(self.decay)}")


def build(cfg, env) -> "WeightEMA | None":
    if not cfg.ema.decay:
        return None
    decay = cfg.ema.decay
    if cfg.ema.adjust:  # the same share of the run averaged whatever the batch, processes or epochs
        samples_between = effective_batch(cfg.train, env.world_size) * cfg.ema.every_steps
        decay = 1.0 - min(1.0, (1.0 - decay) * samples_between / cfg.train.epochs)
    return WeightEMA(decay, cfg.ema.start_step, cfg.ema.every_steps, cfg.ema.warmup_epochs)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard under FSDP, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightEMA(Part):
    name = "ema"
    holds_weights = True

    def __init__(self, decay: float, start_step: int = 0, every_steps: int = 1, warmup_epochs: float = 0.0):
        self.decay, self.start_step = decay, start_step
        self.every_steps, self.warmup_epochs = every_steps, warmup_epochs
        self.plan(steps_per_epoch=None)

    def setup(self, state) -> None:
        if self.warmup_epochs and state.steps_per_epoch is None:
            raise ConfigError("ema.warmup_epochs needs epochs, which a stream has none of; use ema.start_step")
        self.plan(state.steps_per_epoch)
        if is_main():
            every = f"every {self.every_steps} optimizer step(s) of each epoch"
            log(f"ema: decay {self.decay:.6g} {every}, copying the weights to step {self.copy_until}")
        self.attach(state.model)

    def plan(self, steps_per_epoch: int | None) -> None:
        """Where the updates fall in epochs of `steps_per_epoch` (None: one endless epoch, a
        stream), and the last that copies: the first after the warmup."""
        self.steps_per_epoch = steps_per_epoch
        warm = self.start_step
        if self.warmup_epochs and steps_per_epoch:
            warm = max(warm, math.ceil(self.warmup_epochs * steps_per_epoch))
        place = self.place_in_epoch(warm + 1)
        wait = -place % self.every_steps  # to the next update, or to the next epoch's first step
        self.copy_until = warm + 1 + (wait if steps_per_epoch is None else min(wait, steps_per_epoch - place))

    def place_in_epoch(self, step: int) -> int:
        """Optimizer step `step`'s place in its epoch, from 0: updates count from each epoch's start."""
        return step - 1 if self.steps_per_epoch is None else (step - 1) % self.steps_per_epoch

    def after_step(self, state) -> None:
        self.update(state.step)

    def after_load(self, state, path, ckpt: dict, resumed: bool) -> None:
        """The checkpoint's average; none saved (the part just turned on), or fine-tuning from its weights: the
        model's weights."""
        if resumed and has_part(path, ckpt, self.name):
            with self.swapped_into_model():  # loaded as the model's own weights are
                load_weights(state.model, path, ckpt, part=self.name)
            return
        self.reset()
        if resumed and is_main():
            log(f"note: {path} has no {self.name!r} weights; they start from the model's weights")

    def attach(self, model: nn.Module) -> "WeightEMA":
        """Start the average at `model`'s weights (unwrapped: sharded or not)."""
        self.model = model
        self.first, firsts = {}, {}  # each state-dict name's first: a tied tensor is there under each of its names
        for name, tensor in model.state_dict(keep_vars=True).items():
            self.first[name] = firsts.setdefault(id(tensor), name)
        with torch.no_grad():
            self.averages = {name: tensor.detach().clone() for name, tensor in self.live().items()}
        self.averaged = [name for name, tensor in self.averages.items() if tensor.is_floating_point()]
        self.copied = [name for name in self.averages if name not in self.averaged]
        return self

    def live(self) -> dict[str, torch.Tensor]:
        """The model's tensors by the first state-dict name of each (tied weights once),
        looked up each time: FSDP registers its sharded parameters again after a forward."""
        found = dict(self.model.named_parameters(remove_duplicate=False))
        found |= dict(self.model.named_buffers(remove_duplicate=False))
        return {name: found[name] for name in self.first.values()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The average by every state-dict name (what a checkpoint holds)."""
        return {name: self.averages[first] for name, first in self.first.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (counted from 1): at an update, copy the weights through
        copy_until, else average them in."""
        if self.place_in_epoch(step) % self.every_steps:
            return
        if step <= self.copy_until:
            self.reset()
            return
        live = self.live()
        # One fused op for all tensors (torch.optim.swa_utils averages the same way).
        averages, weights = [local(self.averages[n]) for n in self.averaged], [local(live[n]) for n in self.averaged]
        torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        for name in self.copied:
            local(self.averages[name]).copy_(local(live[name]))

    @torch.no_grad()
    def reset(self) -> None:
        """The average := the current weights (also after weights are loaded without one)."""
        live = self.live()
        for name, average in self.averages.items():
            local(average).copy_(local(live[name]))

    @contextlib.contextmanager
    def swapped_into_model(self):
        """The model holds the average inside the block, and its own weights again after."""
        self.swap()
        try:
            yield self.model
        finally:
            self.swap()

    @torch.no_grad()
    def swap(self) -> None:
        for module in self.model.modules():  # FSDP keeps the root's weights gathered after a forward without backward
            if isinstance(module, FSDPModule):
                module.reshard()
        live = self.live()
        for name, average in self.averages.items():
            mine, theirs = local(live[name]), local(average)
            kept = mine.clone()  # one tensor at a time: at most the largest one extra
            mine.copy_(theirs)
            theirs.copy_(kept)
