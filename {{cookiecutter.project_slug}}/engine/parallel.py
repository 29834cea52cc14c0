"""How the model is spread over processes: SyncBatchNorm, activation checkpointing, and
DDP (a full replica per process) or FSDP (parameters, gradients and optimizer state
sharded across processes, for models too big for one device).

Under FSDP the full model never reaches a device: rank 0 builds it once in host memory
(so the initial weights are those of one process with the same seed), the other ranks
build it on the meta device (no memory), every rank shards the empty structure per
block, and each tensor then goes from rank 0 to the shards one at a time. What remains:
rank 0 holds one full copy in host RAM during setup (the other ranks none), and every
rank one full tensor at a time. Weights the model ties (an output layer sharing its
embedding's) stay tied on every rank.
"""

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from engine.config import Config
from engine.distributed import DistEnv, is_main, stop_all_if_any_fails
from engine.errors import TaskError
from engine.logs import log
from engine.precision import AMP_DTYPES

FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def use_sync_batchnorm(requested: bool, device: torch.device, world_size: int) -> bool:
    """SyncBatchNorm only where it works and helps: several processes on CUDA GPUs."""
    return requested and device.type == "cuda" and world_size > 1


def is_sharded(cfg: Config, env: DistEnv) -> bool:
    """Whether FSDP shards the model across processes (on one process it stays whole)."""
    return cfg.train.strategy == "fsdp" and env.world_size > 1


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def build_and_wrap(build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks):
    """The model from `build()` (the task's build_model), ready to train: see wrap_model.
    Under FSDP on several processes it is built and sharded without a full copy on any
    device (see the module's docstring); `build()` must then also run on the meta device."""
    if is_sharded(cfg, env):
        model = build_sharded(build, cfg, env, device, blocks)
        return model, maybe_compile(model, cfg.train.compile)
    return wrap_model(build(), cfg, env, device, blocks)


def build_for_evaluation(build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks):
    """The model evaluate.py loads a checkpoint into: under FSDP on several processes
    sharded as in training (no full copy on any device), otherwise a replica on the device."""
    if is_sharded(cfg, env):
        return build_sharded(build, cfg, env, device, blocks)
    return build().to(device)


def wrap_model(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device, blocks: tuple[type, ...]):
    """SyncBatchNorm conversion, activation checkpointing, the move to the device, then
    DDP or FSDP (in that order: the wrapper must see the final modules on their device).

    Returns (model, train_model): the module to save and evaluate, and the one to train
    (the same module for a single process and for FSDP, which shards it in place).
    """
    model = prepare_modules(model, cfg, env, device, blocks)
    model.to(device, memory_format=memory_format(cfg))
    return model, maybe_compile(wrap_ddp_or_fsdp(model, cfg, env, device, blocks), cfg.train.compile)


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


def build_sharded(build: Callable[[], nn.Module], cfg: Config, env: DistEnv, device: torch.device, blocks):
    """FSDP without a full copy on any device: rank 0 builds the model in host memory,
    the others on meta; all shard the structure on meta, allocate only their shards, and
    receive rank 0's values tensor by tensor. Every rank must call this."""
    with stop_all_if_any_fails(device):  # a build failing on some ranks only stops all
        if is_main():
            model = build()
            full = model.state_dict()  # keeps the values alive while the module goes to meta
            buffers = dict(model.named_buffers())  # also those state_dict leaves out (non-persistent)
            move_to_meta(model)
        else:
            model = build_on_meta(build)
            full, buffers = {}, {}
    model = prepare_modules(model, cfg, env, device, blocks)
    shard(model, cfg, device, blocks)
    model.to_empty(device=device)  # each rank's shards, and the (unsharded) buffers
    set_model_state_dict(model, full, options=FROM_RANK_0)
    fill_buffers_from_rank_0(model, buffers)
    return model


def move_to_meta(model: nn.Module) -> None:
    """The built model's tensors to the meta device, tied ones still tied. `to("meta")`
    gives each module a new tensor of its own, so weights that modules share (an output
    layer tied to its embedding) would come apart on rank 0 while the ranks that built
    the model on meta keep them shared: the ranks' shards would then differ."""
    groups = tied_names(model.named_parameters(remove_duplicate=False))
    groups += tied_names(model.named_buffers(remove_duplicate=False))
    model.to("meta")
    tie(model, groups)


def tied_names(named_tensors) -> list[list[str]]:
    """The names under which one tensor appears several times (tied), a list per tensor."""
    names: dict[torch.Tensor, list[str]] = {}  # tensors hash by identity
    for name, tensor in named_tensors:
        names.setdefault(tensor, []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie(model: nn.Module, groups: list[list[str]]) -> None:
    """Each group's names made one tensor again: the first name's."""
    for first, *others in groups:
        module_name, _, attribute = first.rpartition(".")
        shared = getattr(model.get_submodule(module_name), attribute)
        for name in others:
            module_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(module_name), attribute, shared)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """The model's structure without memory: every tensor on the meta device."""
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, NotImplementedError) as error:  # what reading a meta tensor's value raises
        raise TaskError(
            f"build_model(cfg) fails on the meta device, which FSDP's setup uses on ranks other than 0 ({error}); "
            "create tensors there without reading their values, or use train.strategy=ddp"
        ) from error


@torch.no_grad()
def fill_buffers_from_rank_0(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Rank 0's buffers on every rank, the non-persistent ones (not in a state dict) too."""
    for name, buffer in model.named_buffers():
        if buffers:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's casts: bf16/fp16 parameters for the compute and their all-gathers, fp32
    gradients for the reduce-scatter (summing N low-precision gradients loses bits), fp32
    shards for the optimizer. fp32: no casts at all, so training stays exact."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=AMP_DTYPES[precision], reduce_dtype=torch.float32)


def shard(model: nn.Module, cfg: Config, device: torch.device, blocks) -> None:
    """fully_shard per block, then the root for the rest: one all-gather per block, freed after use."""
    pinned = device.type == "cuda"  # pinned host memory needs a GPU driver
    offload = CPUOffloadPolicy(pin_memory=pinned) if cfg.train.fsdp_cpu_offload else OffloadPolicy()
    policy = mixed_precision(cfg.train.precision)
    check_ties_within_blocks(model, blocks)
    for block in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(block, offload_policy=offload, mp_policy=policy)
    fully_shard(model, offload_policy=offload, mp_policy=policy)


def check_ties_within_blocks(model: nn.Module, blocks) -> None:
    """Refuse, in one line, tied parameters that sharding per block would split: FSDP
    gathers each block's parameters on their own, so a tied parameter must be used
    within one block, or outside every block."""
    owners = {}  # each parameter name's innermost block, or the root: (its name, the module)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, blocks) or module is model:
            for param_name, _ in module.named_parameters(remove_duplicate=False):
                owners[f"{name}.{param_name}" if name else param_name] = (name, module)

    def place(name: str) -> str:
        block_name = owners[name][0]
        return f"{name} (block {block_name})" if block_name else f"{name} (no block)"

    for group in tied_names(model.named_parameters(remove_duplicate=False)):
        if len({id(owners[name][1]) for name in group}) > 1:
            types = sorted({type(owners[name][1]).__name__ for name in group if owners[name][0]})
            raise TaskError(
                f"the tied parameters {' and '.join(map(place, group))} are in different FSDP blocks, which cannot "
                f"share a parameter; take {', '.join(types)} out of model.py's BLOCKS, or use train.strategy=ddp"
            )


def memory_format(cfg: Config) -> torch.memory_format:
    return torch.channels_last if cfg.train.channels_last else torch.preserve_format


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    # Compile the DDP wrapper, not the inner module: DDP's graph-aware bucketing then
    # overlaps communication with the compiled backward.
    return torch.compile(model) if enabled else model


def wrap_again(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """A new DDP wrapper (compiled, with train.compile) for a model whose trainable
    parameters changed: DDP fixes at construction which ones it all-reduces. The old
    wrapper, once dropped, takes its gradient hooks with it."""
    return maybe_compile(wrap_ddp_or_fsdp(model, cfg, env, device, ()), cfg.train.compile)


def wrap_ddp_or_fsdp(model: nn.Module, cfg: Config, env: DistEnv, device: torch.device, blocks) -> nn.Module:
    """The module to train: DDP, FSDP (in place) or, for one process, the model itself."""
    if env.world_size == 1:
        return model
    if cfg.train.strategy == "fsdp":
        shard(model, cfg, device, blocks)
        return model
    return ModelDDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy
        static_graph=cfg.dist.static_graph,
        find_unused_parameters=cfg.dist.find_unused_parameters,
        bucket_cap_mb=cfg.dist.bucket_cap_mb,
    )


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
