"""Run by test_memory.py in the machinery's project, on 1 process or under torchrun:
builds the model as train.py does, takes one AdamW step, and writes what each rank
holds (rank_<r>.json) and its buffers (buffers_<r>.pt), and on rank 0 the initial
weights gathered back (weights.pt), into the folder given first.

  python tests/sharded_setup.py OUT [section.key=value ...]
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from data import DataConfig
from engine.config import load_config
from engine.distributed import cleanup_distributed, init_distributed_mode
from engine.optim import build_optimizer
from engine.parallel import build_and_wrap
from engine.seeding import seed_everything
from model import BLOCKS, ModelConfig, build_model


def local_bytes(tensors) -> int:
    """Bytes this rank holds of these tensors (its shard of a sharded one)."""
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors if isinstance(t, torch.Tensor))


def peak_rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


def main(out: Path, overrides: list[str]) -> None:
    cfg = load_config("config.yaml", overrides, data=DataConfig, model=ModelConfig)
    env, device = init_distributed_mode(cfg.dist)
    seed_everything(cfg.seed)
    model, train_model = build_and_wrap(lambda: build_model(cfg), cfg, env, device, BLOCKS)
    held = {"params": local_bytes(model.parameters()), "setup_peak_mib": peak_rss_mib()}
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.rank == 0:  # now: on one process the weights are the parameters, which the step changes
        torch.save(weights, out / "weights.pt")
    torch.save(dict(model.named_buffers()), out / f"buffers_{env.rank}.pt")
    optimizer = build_optimizer(model, cfg.train, 0.01)
    train_model(torch.randn(4, 3, cfg.data.image_size, cfg.data.image_size)).sum().backward()
    optimizer.step()
    held["optimizer"] = local_bytes(t for state in optimizer.state.values() for t in state.values())
    held["full_params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    (out / f"rank_{env.rank}.json").write_text(json.dumps(held))
    cleanup_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
