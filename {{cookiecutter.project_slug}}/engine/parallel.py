"""How the model is spread over processes: SyncBatchNorm, activation checkpointing, and
DDP (a full replica per process){{ ", unless a part builds and wraps it another way (FSDP:
engine/parts/fsdp.py)" if cookiecutter.fsdp }}."""

import functools
from collections.abc import Callable

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


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
{%- if cookiecutter.fsdp %}


def build_and_wrap(build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks, parts):
    """The model from `build()` (the task's build_model), ready to train, as (model,
    train_model): see wrap_model; or as a part builds it (FSDP, sharded on several processes)."""
    for part in parts:
        built = part.build_model(build, cfg, env, device, blocks)
        if built is not None:
            return built, maybe_compile(built, cfg.train.compile)
    return wrap_model(build(), cfg, env, device, blocks)


def build_for_evaluation(
    build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks, parts
):
    """The model evaluate.py loads a checkpoint into: as a part builds it for training (FSDP:
    sharded, no full copy on any device), otherwise a replica on the device."""
    for part in parts:
        built = part.build_model(build, cfg, env, device, blocks)
        if built is not None:
            return built
    return build().to(device)
{%- else %}


def build_and_wrap(build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks):
    """The model from `build()` (the task's build_model), ready to train, as (model,
    train_model): see wrap_model."""
    return wrap_model(build(), cfg, env, device, blocks)
{%- endif %}


def wrap_model(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device, blocks: tuple[type, ...]):
    """SyncBatchNorm conversion, activation checkpointing, the move to the device, then
    DDP (in that order: the wrapper must see the final modules on their device).

    Returns (model, train_model): the module to save and evaluate, and the one to train
    (the same module for a single process).
    """
    model = prepare_modules(model, cfg, env, device, blocks)
    model.to(device, memory_format=memory_format(cfg))
    return model, maybe_compile(wrap_ddp(model, cfg, env, device), cfg.train.compile)


def prepare_modules(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device, blocks) -> nn.Module:
    """SyncBatchNorm and activation checkpointing: module changes made before any wrapper."""
    if use_sync_batchnorm(cfg.dist.sync_bn, device, env.world_size):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif cfg.dist.sync_bn and env.world_size > 1 and has_batchnorm(model) and is_main():
        log(
            "note: SyncBatchNorm needs CUDA GPUs, so it is skipped here; "
            "each process normalises with its own batch statistics"
        )
    if cfg.train.activation_checkpointing:
        checkpoint_activations(model, blocks)
    return model


def memory_format(cfg: Config) -> torch.memory_format:
    return torch.channels_last if cfg.train.channels_last else torch.preserve_format


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    # Compile the DDP wrapper, not the inner module: DDP's graph-aware bucketing then
    # overlaps communication with the compiled backward.
    return torch.compile(model) if enabled else model


{%- if cookiecutter.freezing %}


def wrap_again(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """A new DDP wrapper (compiled, with train.compile) for a model whose trainable
    parameters changed: DDP fixes at construction which ones it all-reduces. The old
    wrapper, once dropped, takes its gradient hooks with it."""
    return maybe_compile(wrap_ddp(model, cfg, env, device), cfg.train.compile)
{%- endif %}


def wrap_ddp(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """The module to train: DDP or, for one process, the model itself."""
    if env.world_size == 1:
        return model
    ddp = ModelDDP(
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
        settle_buckets(ddp)
    return ddp


def settle_buckets(ddp: DistributedDataParallel) -> None:
    """Give DDP's gradient buckets, now, the layout every step will have. DDP all-reduces
    its first backward in one bucket of every gradient, and lays the buckets out anew after
    it. On 3 or more processes the last bit of a sum depends on where a gradient lies in
    its bucket, so a resumed run's first step, the first of its wrapper, would round
    otherwise than the same step of the run left alone did. A first backward of zero
    gradients, all-reduced and dropped, takes that place in every run. Every rank must
    call this."""
    trained = [p for p in ddp.module.parameters() if p.requires_grad]
    ddp.reducer.prepare_for_backward([])  # what DDP's forward does before a backward
    torch.autograd.backward([p.sum() * 0 for p in trained])
    for p in trained:
        p.grad = None


class ModelDDP(DistributedDataParallel):
    """DDP that also shows the wrapped model's attributes and methods, so training_step
    reads `model.anything` on any number of processes, as on one. Calling the model runs
    DDP's forward, which readies the gradient all-reduce: a step must call it, and
    computing with parameters only through other methods would leave them unsynced."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # DDP's own, and its registered submodules
        except AttributeError:
            if name == "module":  # not set yet (inside DDP's __init__)
                raise
            return getattr(self.module, name)


def checkpoint_activations(model: nn.Module, block_types: tuple[type, ...]) -> int:
    """Recompute the activations of each block in the backward pass instead of keeping
    them: less memory for about one extra forward pass of compute. Returns the number
    of blocks. Each block's forward is replaced on the instance, so parameter names (and
    checkpoints) are the same with and without it.
    """
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    for block in blocks:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
    return len(blocks)
