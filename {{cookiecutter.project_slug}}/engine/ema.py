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

EMA_KEY = "ema"  # its entry in a checkpoint


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard under FSDP, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float, start_step: int):
        self.model, self.decay, self.start_step = model, decay, start_step
        self.names = list(model.state_dict())
        with torch.no_grad():
            self.tensors = {name: tensor.detach().clone() for name, tensor in self.live().items()}
        self.averaged = [name for name, tensor in self.tensors.items() if tensor.is_floating_point()]
        self.copied = [name for name in self.names if name not in self.averaged]

    def live(self) -> dict[str, torch.Tensor]:
        """The model's tensors by state-dict name, looked up each time: FSDP registers its
        sharded parameters again after each forward."""
        found = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        return {name: found[name] for name in self.names}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (counted from 1): average, or follow until start_step."""
        live = self.live()
        copied = self.copied
        if step > self.start_step:
            averages, weights = [local(self.tensors[n]) for n in self.averaged], [local(live[n]) for n in self.averaged]
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        else:
            copied = self.names
        for name in copied:
            local(self.tensors[name]).copy_(local(live[name]))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU. Every rank must call this: under FSDP it gathers."""
        return {
            name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
            for name, tensor in self.tensors.items()
        }

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
        for name, average in self.tensors.items():
            mine, theirs = local(live[name]), local(average)
            kept = mine.clone()  # one tensor at a time: at most the largest one extra
            mine.copy_(theirs)
            theirs.copy_(kept)
