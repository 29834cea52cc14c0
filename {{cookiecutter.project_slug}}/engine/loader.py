"""Samplers and DataLoaders: how samples reach each rank, in which order.

Training: every rank draws from one permutation per epoch (DistributedSampler with the
run's seed and `set_epoch`), rank r taking every world_size-th index. So optimizer step s
sees the same samples whatever the world size, as long as the effective batch
(batch_size * world_size * accum_steps) is the same. Only whole optimizer steps are
drawn; the tail of an epoch (fewer samples than one effective batch) is skipped.

Evaluation: every sample exactly once, no padding, no dropped tail; ranks may get
shards that differ in length by one.
"""

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from engine.config import Config, UsageError
from engine.distributed import DistEnv
from engine.seeding import derive_seed, sample_seeds


class TrainSampler(DistributedSampler):
    """DistributedSampler that draws exactly `num_batches` batches, can start mid-epoch,
    and yields (sample seed, index): the seed is a function of (seed, epoch, index) only."""

    def __init__(self, dataset, env: DistEnv, seed: int, batch_size: int, num_batches: int):
        super().__init__(dataset, env.world_size, env.rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Call before every epoch: it picks the epoch's permutation (and resume point)."""
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self):
        indices = list(super().__iter__())
        begin, end = self.start_batch * self.batch_size, self.num_batches * self.batch_size
        indices = indices[begin:end]
        return zip(sample_seeds(derive_seed(self.seed, self.epoch), indices), indices, strict=True)

    def __len__(self):
        return (self.num_batches - self.start_batch) * self.batch_size


class SeededSamples(Dataset):
    """Makes sample `index` with torch's RNG seeded from the sampler's per-sample seed, so
    random augmentations are a pure function of (seed, epoch, index), not of who loads it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):
        """A batch of (sample seed, index) keys; the DataLoader calls this when it exists.
        Seeds the CPU generator only (torch.manual_seed would also queue a seed for every
        GPU: ~1 ms per call where CUDA is not initialised) and gives the caller its RNG
        state back, saved and restored once per batch: ~1 us per sample in all."""
        generator = torch.default_generator
        caller_state = generator.get_state()
        try:
            samples = []
            for seed, index in keys:
                generator.manual_seed(seed)
                samples.append(self.dataset[index])
            return samples
        finally:
            generator.set_state(caller_state)


class ShardSampler(Sampler):
    """Rank r evaluates indices r, r + world_size, ...: every sample once, none padded.
    `yielded` counts the indices handed out since the last `iter()`."""

    def __init__(self, length: int, env: DistEnv):
        self.indices = range(env.rank, length, env.world_size)
        self.yielded = 0

    def __iter__(self):
        self.yielded = 0
        for index in self.indices:
            self.yielded += 1
            yield index

    def __len__(self):
        return len(self.indices)


def micro_batches_per_epoch(dataset_size: int, cfg: Config, env: DistEnv) -> int:
    """Micro-batches each rank runs per epoch: whole optimizer steps only."""
    effective_batch = cfg.train.batch_size * env.world_size * cfg.train.accum_steps
    steps = dataset_size // effective_batch
    if steps == 0:
        raise UsageError(
            f"the training set has {dataset_size} samples, fewer than one effective batch "
            f"({cfg.train.batch_size} x {env.world_size} processes x {cfg.train.accum_steps} "
            f"accum_steps = {effective_batch}); lower train.batch_size or train.accum_steps"
        )
    return steps * cfg.train.accum_steps


def steps_per_epoch(train_loader: DataLoader, cfg: Config) -> int:
    """Optimizer steps per epoch (the train loader draws whole steps only)."""
    return train_loader.sampler.num_batches // cfg.train.accum_steps


def build_train_loader(dataset: Dataset, cfg: Config, env: DistEnv, device: torch.device, collate_fn) -> DataLoader:
    """`collate_fn` makes a batch from a list of samples (None: torch's default_collate)."""
    sampler = TrainSampler(
        dataset, env, cfg.seed, cfg.train.batch_size, micro_batches_per_epoch(len(dataset), cfg, env)
    )
    return make_loader(SeededSamples(dataset), sampler, cfg.train.batch_size, cfg, device, collate_fn)


def build_val_loader(dataset: Dataset, cfg: Config, env: DistEnv, device: torch.device, collate_fn) -> DataLoader:
    sampler = ShardSampler(len(dataset), env)
    return make_loader(dataset, sampler, cfg.train.eval_batch_size, cfg, device, collate_fn)


class RankDataLoader(DataLoader):
    """A DataLoader over this rank's share. An error it raises (an unreadable file) is
    this rank's alone, so this rank reports it, not rank 0, which never saw it."""

    def __iter__(self):
        try:
            yield from super().__iter__()
        except UsageError as error:
            error.local = True
            raise


def make_loader(dataset, sampler, batch_size: int, cfg: Config, device: torch.device, collate_fn) -> DataLoader:
    workers = cfg.train.num_workers
    return RankDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,  # None: torch's default_collate
        num_workers=workers,
        pin_memory=device.type == "cuda",  # pinned host memory only helps copies to a GPU
        persistent_workers=workers > 0,  # no worker start-up cost at every epoch
        prefetch_factor=2 if workers > 0 else None,
        drop_last=False,  # TrainSampler already yields whole batches only
        # Its own generator: creating an iterator must not draw from the global RNG, or
        # a resumed run's dropout would diverge from the uninterrupted run's.
        generator=torch.Generator().manual_seed(cfg.seed),
    )
