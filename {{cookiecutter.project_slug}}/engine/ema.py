"""An exponential moving average (EMA) of the model's weights (train.ema_decay).

After every optimizer step: ema = decay x ema + (1 - decay) x weights, one fused op on the
device, no host sync. Until train.ema_start_step it simply follows the weights. The
average covers the model's state dict (parameters and persistent buffers; integer
buffers such as BatchNorm's batch count are copied). Under FSDP it holds each tensor
sharded like the model, so no rank holds the whole average either.

To evaluate it, `swapped_into_model()` exchanges it with the model's weights in place
(exact copies, both ways), so the same model, sharded or not, evaluates either.
"""

import contextlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine.distributed import is_main

EMA_KEY = "ema"  # its entry in a checkpoint


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard under FSDP, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float, start_step: int):
        self.model, self.decay, self.start_step = model, decay, start_step
        self.names = list(model.state_dict())  # a tied tensor is there under each of its names
        with torch.no_grad():
            self.averages = {name: tensor.detach().clone() for name, tensor in self.live().items()}
        self.averaged = [name for name, tensor in self.averages.items() if tensor.is_floating_point()]
        self.copied = [name for name in self.averages if name not in self.averaged]

    def live(self) -> dict[str, torch.Tensor]:
        """The model's tensors by the first state-dict name of each (tied weights once),
        looked up each time: FSDP registers its sharded parameters again after a forward."""
        found = dict(self.model.named_parameters(remove_duplicate=False))
        found |= dict(self.model.named_buffers(remove_duplicate=False))
        unique, seen = {}, set()
        for name in self.names:
            if id(found[name]) not in seen:
                seen.add(id(found[name]))
                unique[name] = found[name]
        return unique

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The average by every state-dict name (what a checkpoint holds)."""
        found = dict(self.model.named_parameters(remove_duplicate=False))
        found |= dict(self.model.named_buffers(remove_duplicate=False))
        first = {}
        for name in self.names:
            first.setdefault(id(found[name]), name)
        return {name: self.averages[first[id(found[name])]] for name in self.names}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (counted from 1): average, or follow until start_step."""
        if step <= self.start_step:
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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU, on rank 0 ({} elsewhere, as for the model's). Every
        rank must call this: under FSDP it gathers."""
        whole = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in self.tensors.items()}
        return {name: t.detach().cpu() for name, t in whole.items()} if is_main() else {}

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
