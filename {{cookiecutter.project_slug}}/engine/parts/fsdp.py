"""FSDP (a part): parameters, gradients and optimizer state sharded across processes, for
models too big for one device (fsdp.enabled; DDP's replica per process otherwise).

The full model never reaches a device: rank 0 builds it once in host memory (so the
initial weights are those of one process with the same seed), the other ranks build it
on the meta device (no memory), every rank shards the empty structure per block
(model.py's BLOCKS), and each tensor then goes from rank 0 to the shards one at a time.
What remains: rank 0 holds one full copy in host RAM during setup (the other ranks none),
and every rank one full tensor at a time. Weights the model ties (an output layer sharing
its embedding's) stay tied on every rank. Checkpoints are folders of every rank's shards
(engine/sharded.py, this part's FOLDERS) on any number of processes: one kind per run.
"""

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
{% if cookiecutter.host_tuning %}from engine.host import M_MMAP_THRESHOLD
{% endif %}from engine.parallel import prepare_modules
from engine.parts import Part
from engine.training import AMP_DTYPES

FOLDERS = sharded  # reads and writes checkpoint folders, for any run of this project (DDP resumes them too)
FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass
class Section:
    enabled: bool = False  # shard the model, its gradients and optimizer state across processes; false: DDP
    cpu_offload: bool = False  # keep the sharded parameters in CPU memory


def build(cfg, env: DistEnv) -> "Fsdp | None":
    return Fsdp(env) if cfg.fsdp.enabled else None


class Fsdp(Part):
    name = "fsdp"
    saves_sharded = True  # checkpoints are sharded folders, on one process too
{%- if cookiecutter.host_tuning %}
    # Blocks above glibc's initial 128 KiB get their own mmap and go back when freed: each
    # block's parameters are gathered whole and its gradients made whole for every use,
    # then freed, in blocks of every size; kept in the heap, they fragment it and the
    # sharding's saving is lost. Measured on a 101M-parameter MLP of 24 blocks with AdamW
    # on 2 CPU processes, the step's peak RSS per rank was 1,590 MiB with this, 2,827-3,172
    # with glibc's defaults and 3,147-3,347 with the core's setting (DDP itself: 2,443-2,531).
    # Set before setup (train.py), since setup frees one full tensor after another on every
    # rank: with a 12-block MLP of 49 MiB on 2 processes, rank 1 held 2.3-2.7x the weights
    # above its start when its first step began, 0.52x with this set first.
    host_allocator = {M_MMAP_THRESHOLD: 128 * 2**10}
{%- endif %}

    def __init__(self, env: DistEnv):
        self.shards_model = env.world_size > 1  # on one process the model stays whole

    def build_model(self, build: Callable[[], nn.Module], cfg, env, device, blocks) -> nn.Module | None:
        if not self.shards_model:
            return None
        return build_sharded(build, cfg, env, device, blocks)


def build_sharded(build: Callable[[], nn.Module], cfg, env: DistEnv, device: torch.device, blocks):
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
            "create tensors there without reading their values, or set fsdp.enabled=false"
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


def shard(model: nn.Module, cfg, device: torch.device, blocks) -> None:
    """fully_shard per block, then the root for the rest: one all-gather per block, freed after use."""
    pinned = device.type == "cuda"  # pinned host memory needs a GPU driver
    offload = CPUOffloadPolicy(pin_memory=pinned) if cfg.fsdp.cpu_offload else OffloadPolicy()
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
                f"share a parameter; take {', '.join(types)} out of model.py's BLOCKS, or set fsdp.enabled=false"
            )
