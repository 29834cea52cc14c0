"""Each rank's peak RSS during setup, training and a checkpoint save, through the
generated project's own functions and settings (train.py's setup, its host-memory
setting, an epoch of Run.train_epoch, Checkpointer.save). Run by bench.py in a baked
project, on one process or under torchrun:

  python memory_phases.py OUT.json section.key=value ...

The model is a deep MLP (DEPTH blocks of WIDTH features, the example's MLPBlock, so
FSDP shards it block by block): about 101M parameters, the size where sharding matters
more than the runtime's own ~680 MiB per process. The peak is reset between phases
(Linux's /proc/self/clear_refs), so each figure is its own phase's. Writes one JSON row
per rank to OUT.json.<rank>.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the baked project

import model  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
import train  # noqa: E402
from data import count_classes  # noqa: E402
from engine.checkpoint import Checkpointer  # noqa: E402
from engine.distributed import cleanup_distributed, init_distributed_mode  # noqa: E402
from engine.hooks import build_parts  # noqa: E402
from engine.lifecycle import StopRequest  # noqa: E402
from engine.logs import QuietLog  # noqa: E402
from engine.parts.memory import train_state_mib  # noqa: E402
from engine.sharded import sharded_state_dict  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

DEPTH, WIDTH = 24, 2048


def build_deep_mlp(cfg) -> nn.Module:
    blocks = [model.MLPBlock(WIDTH, WIDTH, 0.0) for _ in range(DEPTH)]
    stem = nn.Linear(3 * cfg.data.image_size**2, WIDTH)
    return nn.Sequential(nn.Flatten(), stem, *blocks, nn.Linear(WIDTH, count_classes(cfg)))


def status_mib(key: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key))
    return int(line.split()[1]) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def async_save_s(state, directory: Path, group) -> dict:
    """torch.distributed.checkpoint's async_save of the same shards: the time training
    waits (staging a copy of this rank's shards) and the time until the files are
    written, in seconds. Not what the project does (it saves synchronously): measured to
    weigh it."""
    started = time.perf_counter()
    writing = dcp.async_save(
        sharded_state_dict(state.model, state.optimizer),
        storage_writer=FileSystemWriter(str(directory)),
        process_group=group,
    )
    blocked = time.perf_counter() - started
    writing.result()
    return {"async_blocked_s": blocked, "async_done_s": time.perf_counter() - started}


def main(out: str, overrides: list[str]) -> None:
    cfg = train.load_config(None, overrides, data=train.DataConfig, model=train.ModelConfig, optim=train.OptimConfig)
    env, device = init_distributed_mode(cfg.dist)
    reset_peak()
    row = {"rank": env.rank, "runtime_mib": status_mib("VmRSS")}  # torch and the process group
    train.build_model, train.BLOCKS = build_deep_mlp, (model.MLPBlock,)  # what load_train_objs builds
    checkpointer = Checkpointer(cfg, env, device)
    parts = build_parts(cfg, env)  # the host_tuning part sets the steps' allocator here, as in train.py
    sharded = any(part.shards_model for part in parts)
    train_loader, val_loader, state = train.load_train_objs(cfg, env, device, checkpointer, parts, None)
    row["setup_peak_mib"] = status_mib("VmHWM")
    stop = StopRequest(cfg.dist.timeout_minutes, cfg.train.stop_at_step).install(env.launcher)
    reset_peak()
    train.Run(cfg, env, state, (train_loader, val_loader), checkpointer, stop, QuietLog()).train_epoch()
    row["step_peak_mib"] = status_mib("VmHWM")
    row |= train_state_mib(state)
    reset_peak()
    started = time.perf_counter()
    checkpointer.save(state)
    row["save_s"] = time.perf_counter() - started
    row["save_peak_mib"] = status_mib("VmHWM")
    if sharded:  # its own gloo group: the writes' collectives run beside training's
        row |= async_save_s(state, Path(cfg.output_dir) / "async", dist.new_group(backend="gloo"))
    Path(f"{out}.{env.rank}").write_text(json.dumps(row))
    cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
