"""FSDP (a part): the model sharded per block; rank 0 builds it in host memory, the other ranks on meta."""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from engine import sharded
from engine.distributed import DistEnv, is_main, stop_all_if_any_fails
from engine.errors import TaskError
from engine.hooks import Part
from engine.parallel import prepare_modules
from engine.training import AMP_DTYPES

MOVED_KEYS = {
    "train.strategy": ("fsdp.enabled", "set fsdp.enabled=true for strategy fsdp, false for ddp"),
    "train.fsdp_cpu_offload": "fsdp.cpu_offload",
}
FOLDERS = sharded  # reads and writes checkpoint folders, for any run of this project (DDP resumes them too)


@dataclass
class Section:
    enabled: bool = False  # shard the model, its gradients and optimizer state across processes; false: DDP
    cpu_offload: bool = False  # keep the sharded parameters in CPU memory


def build(cfg, env: DistEnv) -> "Fsdp | None":
    return Fsdp(env) if cfg.fsdp.enabled else None


class Fsdp(Part):
    name = "fsdp"
    saves_sharded = True  # checkpoints are sharded folders, on one process too

    def __init__(self, env: DistEnv):
        self.shards_model = env.world_size > 1  # on one process the model stays whole

    def build_model(self, build: Callable[[], nn.Module], cfg, env, device, blocks) -> nn.Module | None:
        """Every rank must call this."""
        if not self.shards_model:
            return None
        with stop_all_if_any_fails(device):  # a build failing on some ranks only stops all
            if is_main():
                model = build()
                full, buffers = model.state_dict(), dict(model.named_buffers())
                move_to_meta(model)
            else:
                model, full, buffers = build_on_meta(build), {}, {}
        model = prepare_modules(model, cfg, env, device, blocks)
        check_ties_within_blocks(model, blocks)
        # fp32 gradients for the reduce-scatter: a sum of N low-precision gradients loses bits.
        dtype = AMP_DTYPES.get(cfg.train.precision)  # None for fp32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.fsdp.cpu_offload else OffloadPolicy()
        for module in [*(m for m in model.modules() if isinstance(m, blocks)), model]:
            fully_shard(module, offload_policy=offload, mp_policy=policy)
        model.to_empty(device=device)  # each rank's shards, and the (unsharded) buffers
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        with torch.no_grad():
            for name, buffer in model.named_buffers():  # rank 0's, the non-persistent ones too
                if buffers:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
        model.no_sync = functools.partial(no_gradient_sync, model)  # what the loop calls to accumulate (as DDP's)
        return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def move_to_meta(model: nn.Module) -> None:
    """Tied tensors stay tied: `to("meta")` alone unties them, and rank 0's shards would differ from the rest."""
    groups = tied_names(model.named_parameters(remove_duplicate=False))
    groups += tied_names(model.named_buffers(remove_duplicate=False))
    model.to("meta")
    for first, *others in groups:
        shared = getattr(*owner(model, first))
        for name in others:
            setattr(*owner(model, name), shared)


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attribute = name.rpartition(".")
    return model.get_submodule(module_name), attribute


def tied_names(named_tensors) -> list[list[str]]:
    names: dict[torch.Tensor, list[str]] = {}  # tensors hash by identity
    for name, tensor in named_tensors:
        names.setdefault(tensor, []).append(name)
    return [group for group in names.values() if len(group) > 1]


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, NotImplementedError) as error:  # what reading a meta tensor's value raises
        raise TaskError(
            f"build_model(cfg) fails on the meta device, which FSDP's setup uses on ranks other than 0 ({error}); "
            "create tensors there without reading their values, or set fsdp.enabled=false"
        ) from error


def check_ties_within_blocks(model: nn.Module, blocks) -> None:
    """FSDP gathers each block on its own: a tied parameter must stay within one block, or outside all."""
    owners = {}  # each parameter name's innermost block, or the root: (its name, the module)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, blocks) or module is model:
            for param_name, _ in module.named_parameters(remove_duplicate=False):
                owners[f"{name}.{param_name}" if name else param_name] = (name, module)
    for group in tied_names(model.named_parameters(remove_duplicate=False)):
        if len({id(owners[name][1]) for name in group}) > 1:
            places = " and ".join(f"{n} ({'block ' + owners[n][0] if owners[n][0] else 'no block'})" for n in group)
            types = sorted({type(owners[name][1]).__name__ for name in group if owners[name][0]})
            raise TaskError(
                f"the tied parameters {places} are in different FSDP blocks, which cannot "
                f"share a parameter; take {', '.join(types)} out of model.py's BLOCKS, or set fsdp.enabled=false"
            )
