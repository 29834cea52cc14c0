"""Run by test_fsdp.py in the machinery's project, on 1 process or under torchrun:
builds the model as train.py does, takes two AdamW steps with train.py's host-memory
setting, and saves a sharded checkpoint. Writes into the folder given first what each
rank holds and its peak RSS above the runtime's in each phase (rank_<r>.json), its
buffers (buffers_<r>.pt), and on rank 0 the initial weights gathered back (weights.pt).

  python tests/sharded_setup.py OUT [--deep-mlp] [section.key=value ...]

--deep-mlp builds DEPTH blocks of WIDTH features (the example's MLPBlock; 25M parameters,
100 MiB) instead of model.py's model: FSDP gathers one small block at a time, so a full
copy of the weights stands out in a rank's peak.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from data import DataConfig
from engine.config import load_config
from engine.distributed import cleanup_distributed, init_distributed_mode
from engine.hooks import build_parts
from engine.parallel import build_and_wrap
from engine.seeding import seed_everything
from engine.sharded import save_sharded, sharded_state_dict
from model import BLOCKS, MLPBlock, ModelConfig, build_model
from recipe import OptimConfig, build_optimizer

DEPTH, WIDTH = 24, 1024


def build_deep_mlp(cfg) -> nn.Module:
    stem = nn.Linear(3 * cfg.data.image_size**2, WIDTH)
    return nn.Sequential(nn.Flatten(), stem, *[MLPBlock(WIDTH, WIDTH, 0.0) for _ in range(DEPTH)], nn.Linear(WIDTH, 10))


def local_bytes(tensors) -> int:
    """Bytes this rank holds of these tensors (its shard of a sharded one)."""
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors if isinstance(t, torch.Tensor))


def status_mib(key: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(key)).split()[1]) / 1024


class PhasePeaks:
    """Each phase's peak RSS above the RSS at its start (Linux resets the peak)."""

    def __init__(self):
        self.floor = self.restart()

    def restart(self) -> float:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return status_mib("VmRSS")

    def end(self) -> float:
        peak = status_mib("VmHWM") - self.floor
        self.floor = self.restart()
        return peak


def main(out: Path, overrides: list[str], deep_mlp: bool) -> None:
    build, blocks = (build_deep_mlp, (MLPBlock,)) if deep_mlp else (build_model, BLOCKS)
    cfg = load_config("config.yaml", overrides, data=DataConfig, model=ModelConfig, optim=OptimConfig)
    env, device = init_distributed_mode(cfg.dist)
    peaks = PhasePeaks()  # from here: above the runtime (torch, the process group)
    seed_everything(cfg.seed)
    parts = build_parts(cfg, env)  # the host_tuning part, if any, sets the allocator for the steps here
    model, train_model = build_and_wrap(lambda: build(cfg), cfg, env, device, blocks, parts)
    held = {"params": local_bytes(model.parameters()), "setup_peak_mib": peaks.end()}
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.rank == 0:  # now: on one process the weights are the parameters, which the step changes
        torch.save(weights, out / "weights.pt")
    torch.save(dict(model.named_buffers()), out / f"buffers_{env.rank}.pt")
    del weights
    peaks.end()  # the weights gathered for the test
    optimizer = build_optimizer(model, cfg, env.world_size, {})
    for _ in range(2):
        train_model(torch.randn(4, 3, cfg.data.image_size, cfg.data.image_size)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held["step_peak_mib"] = peaks.end()
    held["optimizer"] = local_bytes(t for state in optimizer.state.values() for t in state.values())
    held["full_params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    save_sharded(sharded_state_dict(model, optimizer), out / "checkpoint", out / "checkpoint")
    held["save_peak_mib"] = peaks.end()
    (out / f"rank_{env.rank}.json").write_text(json.dumps(held))
    cleanup_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [arg for arg in sys.argv[2:] if arg != "--deep-mlp"], "--deep-mlp" in sys.argv)
