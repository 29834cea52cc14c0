"""The baseline: a minimal hand-written DDP training loop, as in PyTorch's tutorials.

Same model (build_model), data and augmentation (build_datasets) as the generated
project, and exactly its recipe: the optimizer with its two parameter groups (weight
decay on weights only), momentum, the per-step learning-rate schedule, the batch and the
sampler order. No evaluation, checkpoints, logging, per-sample seeding or allocator
settings. Run inside a baked project folder:
    torchrun --nproc_per_node=N handwritten.py '<overrides as JSON>' OUT
Prints one JSON line per rank: step times, throughput, page faults and peak RSS.
"""

import inspect
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, ".")
from data import DataConfig, build_datasets  # noqa: E402  (the baked project's own modules)
from engine.config import load_config  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402
from recipe import OptimConfig, build_optimizer, build_scheduler  # noqa: E402


def main():
    start = time.perf_counter()
    cfg = load_config("config.yaml", json.loads(sys.argv[1]), data=DataConfig, model=ModelConfig, optim=OptimConfig)
    distributed = "RANK" in __import__("os").environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    train_set, _ = build_datasets(cfg)
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    trained = DDP(model) if world > 1 else model
    # build_optimizer takes the parameters that join later (none here); bakes before 0.9.0 without freezing did not.
    joins_later = [{}] if "joins_later" in inspect.signature(build_optimizer).parameters else []
    optimizer = build_optimizer(model, cfg, world, *joins_later)
    scheduler = build_scheduler(optimizer, cfg, len(loader))
    step_times, train_time = [], 0.0
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for epoch in range(cfg.train.epochs):
        sampler.set_epoch(epoch)
        epoch_start = last = time.perf_counter()
        for images, labels in loader:
            loss = F.cross_entropy(trained(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
        train_time += time.perf_counter() - epoch_start
    if rank == 0:
        torch.save(model.state_dict(), sys.argv[2])
    samples = len(step_times) * cfg.train.batch_size * world
    print(
        json.dumps(
            {
                "rank": rank,
                "step_time_median_s": statistics.median(step_times),
                "samples_per_s": samples / train_time,
                "train_time_s": train_time,
                "loop_faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
                / len(step_times),
                "in_process_s": time.perf_counter() - start,
                "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        ),
        flush=True,
    )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
