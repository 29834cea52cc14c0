"""How the model is spread over processes: SyncBatchNorm, activation checkpointing, and
DDP (a full replica per process), unless a part builds and wraps it (its own strategy, e.g. sharding)."""

import functools

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from engine.config import Config
from engine.distributed import DistEnv, is_main
from engine.logs import log


def use_sync_batchnorm(requested: bool, device: torch.device, world_size: int) -> bool:
    """SyncBatchNorm only where it works and helps: several processes on CUDA GPUs."""
    return requested and device.type == "cuda" and world_size > 1


def build_and_wrap(build, cfg: Config, env: DistEnv, device: torch.device, blocks, parts=()):
    """The model from `build()` (the task's build_model) as (the module to save and evaluate,
    the one to train): as a part builds it, else its modules changed, moved to the device, then
    wrapped, in that order (the wrapper must see the final modules on their device)."""
    if (model := built_by_part(build, cfg, env, device, blocks, parts)) is not None:
        return model, torch.compile(model) if cfg.train.compile else model
    model = prepare_modules(build(), cfg, env, device, blocks).to(device, memory_format=memory_format(cfg))
    return model, wrap_ddp(model, cfg, env, device)


def build_for_evaluation(build, cfg: Config, env: DistEnv, device: torch.device, blocks, parts) -> nn.Module:
    """The model evaluate.py loads into: as a part builds it (e.g. sharded), else on the device."""
    model = built_by_part(build, cfg, env, device, blocks, parts)
    return build().to(device) if model is None else model


def built_by_part(build, cfg: Config, env: DistEnv, device: torch.device, blocks, parts) -> nn.Module | None:
    return next((m for part in parts if (m := part.build_model(build, cfg, env, device, blocks)) is not None), None)


def prepare_modules(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device, blocks) -> nn.Module:
    """SyncBatchNorm and activation checkpointing: module changes made before any wrapper."""
    if use_sync_batchnorm(cfg.dist.sync_bn, device, env.world_size):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif cfg.dist.sync_bn and env.world_size > 1 and is_main():
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            log(
                "note: SyncBatchNorm needs CUDA GPUs, so it is skipped here; "
                "each process normalises with its own batch statistics"
            )
    if cfg.train.activation_checkpointing:
        checkpoint_activations(model, blocks)
    return model


def memory_format(cfg: Config) -> torch.memory_format:
    return torch.channels_last if cfg.train.channels_last else torch.preserve_format


def wrap_ddp(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """The module to train: DDP (the model itself for one process), compiled with train.compile."""
    if env.world_size > 1:
        model = ModelDDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy
            static_graph=cfg.dist.static_graph,
            find_unused_parameters=cfg.dist.find_unused_parameters,
            bucket_cap_mb=cfg.dist.bucket_cap_mb,
        )
        # With find_unused_parameters DDP never lays its buckets out again; a static graph
        # takes its first backward for the graph's record, which must be a real step's.
        if not (cfg.dist.find_unused_parameters or cfg.dist.static_graph):
            # Give the buckets now the layout every step will have. DDP all-reduces its first
            # backward in one bucket and lays them out anew after it; on 3 or more processes a
            # sum's last bit depends on a gradient's place in its bucket, so a resumed run's
            # first step would round otherwise than the run left alone did. A first backward
            # of zero gradients, all-reduced and dropped, takes that place in every run.
            model.reducer.prepare_for_backward([])  # what DDP's forward does before a backward
            torch.autograd.backward([p.sum() * 0 for p in model.module.parameters() if p.requires_grad])
            model.module.zero_grad(set_to_none=True)
    # Compile the DDP wrapper, not the inner module: DDP's graph-aware bucketing then
    # overlaps communication with the compiled backward.
    return torch.compile(model) if cfg.train.compile else model


class ModelDDP(DistributedDataParallel):
    """DDP that also shows the wrapped model's attributes and methods, so training_step
    reads `model.anything` on any number of processes, as on one. Calling the model runs
    DDP's forward, which readies the gradient all-reduce: a step must call it, and
    computing with parameters only through other methods would leave them unsynced."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # DDP's own, and its registered submodules
        except AttributeError:  # `module` itself raises until DDP's __init__ sets it
            return getattr(super().__getattr__("module"), name)


def checkpoint_activations(model: nn.Module, block_types: tuple[type, ...]) -> int:
    """Recompute each block's activations in the backward pass instead of keeping them:
    less memory for about one more forward pass. Each block's forward is replaced on the
    instance, so parameter names (and checkpoints) are the same. Returns the blocks' number."""
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    for block in blocks:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
    return len(blocks)
