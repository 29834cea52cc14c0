"""Samplers and DataLoaders: how samples reach each rank, in which order.

Training: one permutation per epoch (DistributedSampler, seeded, `set_epoch`), rank r taking
every world_size-th index, so step s sees the same samples at any world size with the same
effective batch. Evaluation: fixed batches in dataset order, dealt whole to ranks (EvalBatches).
"""

import collections
import contextlib
import dataclasses
import inspect
import numbers
from collections.abc import Callable, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from engine.config import Config, effective_batch
from engine.distributed import DistEnv, agreed, all_gather_objects
from engine.errors import UsageError
from engine.seeding import borrowed_rng, derive_seed, sample_seeds


class TrainSampler(DistributedSampler):
    """DistributedSampler drawing exactly `num_batches` batches, from `start_batch` on, as
    (sample seed, index): the seed depends on (seed, epoch, index) only. `order`: data.py's
    `train_order`, the epoch's indices over all ranks in place of the permutation."""

    def __init__(self, dataset, env: DistEnv, seed: int, batch_size: int, num_batches=0, order: Callable | None = None):
        super().__init__(dataset, env.world_size, env.rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size, self.num_batches, self.order = batch_size, num_batches, order
        self.start_batch, self.epoch_samples = 0, None
        self.epoch_samples = len(self.epoch_order()) if order else len(dataset)  # the same every epoch

    def epoch_order(self) -> list[int]:
        """data.py's train_order for this epoch, checked, and the same on every rank; its
        generator is seeded as the permutation's, so that randperm(n, generator) is the built-in order."""
        size = len(self.dataset)
        order = indices_of(self.order(size, torch.Generator().manual_seed(self.seed + self.epoch)), self.epoch)
        if any(not 0 <= i < size for i in order) or self.epoch_samples not in (None, len(order)):
            raise UsageError(
                f"data.py's train_order gave {len(order)} indices for epoch {self.epoch}; give the same number "
                f"every epoch, each in [0, {size}) (the training set's samples)"
            )
        if len(set(all_gather_objects(hash(tuple(order))))) > 1:  # once an epoch: every rank must deal the same order
            raise agreed(
                UsageError(
                    f"data.py's train_order gave each process another order for epoch {self.epoch}; draw it from "
                    "its `generator` argument (e.g. torch.randperm(num_samples, generator=generator)), not torch's "
                    "global RNG"
                )
            )
        return order

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_batch = start_batch

    def __iter__(self):
        if self.order is None:
            indices = keys = list(super().__iter__())
        else:
            order, seen, size = self.epoch_order(), collections.Counter(), len(self.dataset)
            keys = []
            for index in order:  # the n-th repeat of an index is seeded as index + n x size
                keys.append(index + seen[index] * size)
                seen[index] += 1
            indices, keys = order[self.rank :: self.num_replicas], keys[self.rank :: self.num_replicas]
        begin, end = self.start_batch * self.batch_size, self.num_batches * self.batch_size
        seeds = sample_seeds(derive_seed(self.seed, self.epoch), keys[begin:end])
        return zip(seeds, indices[begin:end], strict=True)

    def __len__(self):
        return (self.num_batches - self.start_batch) * self.batch_size


def indices_of(order, epoch: int) -> list[int]:
    """train_order's return value as a list of indices: integers only (0.9 is no index, nor
    True, nor "3"), in a list, a tuple or a 1-D integer tensor; else one line naming it."""
    if is_integer(order, ndim=1):
        order = order.tolist()
    what = f"data.py's train_order returned {type(order).__name__} for epoch {epoch}"
    if not isinstance(order, (list, tuple, range)):
        raise UsageError(f"{what}; return a list (or a 1-D integer tensor) of training sample indices")
    if not order:
        raise UsageError(f"{what} with no indices; return the epoch's order, as torch.randperm(num_samples, generator)")
    bad = next((item for item in order if type(item) is not int and not is_integer(item)), None)
    if bad is not None:
        raise UsageError(f"{what} holding {type(bad).__name__} {str(bad)[:40]!r}; give integer indices only")
    return [int(item) for item in order]


def is_integer(item, ndim: int = 0) -> bool:
    """An integer that is not a bool: Python's, numpy's, or an integer tensor of `ndim` dimensions."""
    if isinstance(item, torch.Tensor):
        return item.ndim == ndim and not (item.is_floating_point() or item.is_complex() or item.dtype == torch.bool)
    return ndim == 0 and isinstance(item, numbers.Integral) and not isinstance(item, bool)


class SeededSamples(Dataset):
    """Makes each sample with torch's RNG seeded by the sampler: augmentations depend on
    (seed, epoch, index), not on which rank or worker loads it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys):
        """A batch of (seed, index) keys. The CPU generator only (torch.manual_seed also
        seeds every GPU, ~1 ms a call), given back once per batch."""
        with borrowed_rng(cpu_generator_only=True) as generator:
            samples = []
            for seed, index in keys:
                generator.manual_seed(seed)
                samples.append(self.dataset[index])
            return samples


class EvalBatches(Sampler):
    """Fixed batches in dataset order, rank r taking batches r, r + N, ...: every sample
    once, unpadded, in the same batch on any number of processes N, so with the same bits."""

    def __init__(self, length: int, batch_size: int, env: DistEnv):
        self.length, self.batch_size = length, batch_size
        self.rank, self.world_size = env.rank, env.world_size
        self.num_batches = -(-length // batch_size)  # over all ranks
        self.batch_ids = self.mine(self.num_batches)

    def mine(self, num_batches: int) -> range:
        """This rank's share of the first `num_batches` batches."""
        return range(self.rank, num_batches, self.world_size)

    def samples_in(self, batch_id: int) -> int:
        return min(self.batch_size, self.length - batch_id * self.batch_size)

    def __iter__(self):
        for batch_id in self.batch_ids:
            start = batch_id * self.batch_size
            yield list(range(start, start + self.samples_in(batch_id)))

    def __len__(self):
        return len(self.batch_ids)


def micro_batches_per_epoch(dataset_size: int, cfg: Config, env: DistEnv) -> int:
    """Micro-batches each rank runs per epoch: whole optimizer steps only."""
    per_step = effective_batch(cfg.train, env.world_size)
    steps = dataset_size // per_step
    if steps == 0:
        raise UsageError(
            f"the training set has {dataset_size} samples, fewer than one effective batch "
            f"({cfg.train.batch_size} x {env.world_size} processes x {cfg.train.accum_steps} "
            f"accum_steps = {per_step}); lower train.batch_size or train.accum_steps"
        )
    return steps * cfg.train.accum_steps


def steps_per_epoch(train_loader: DataLoader, cfg: Config) -> int | None:
    """Optimizer steps per epoch; None for a part's loader (a stream's length shows only at its end)."""
    sampler = train_loader.sampler
    return sampler.num_batches // cfg.train.accum_steps if isinstance(sampler, TrainSampler) else None


def build_train_loader(
    dataset: Dataset, cfg: Config, env: DistEnv, device: torch.device, parts=(), vote_group=None, **hooks
) -> DataLoader:
    """`hooks`: collate_fn, worker_init_fn and train_order (data.py's). A part may read the
    dataset instead (a stream, whose ranks vote on `vote_group`)."""
    for part in parts:
        if (loader := part.train_loader(dataset, device, hooks, vote_group)) is not None:
            return loader
    if isinstance(dataset, IterableDataset):
        raise UsageError(
            "the training set is a stream (an IterableDataset), which this project, generated without the streams "
            "part, cannot read: return a map-style Dataset (len() and indexing), or generate with streams=yes"
        )
    order = hooks.get("train_order")
    sampler = TrainSampler(dataset, env, cfg.seed, cfg.train.batch_size, order=order and with_settings(order, cfg))
    sampler.num_batches = micro_batches_per_epoch(sampler.epoch_samples, cfg, env)
    return make_loader(SeededSamples(dataset), cfg, device, hooks, sampler=sampler, batch_size=cfg.train.batch_size)


def with_settings(train_order: Callable, cfg: Config) -> Callable:
    """data.py's train_order(num_samples, generator, cfg) with the run's settings bound."""
    try:
        inspect.signature(train_order).bind(0, None, cfg)
    except TypeError:
        raise UsageError(
            "data.py's train_order must take (num_samples, generator, cfg): cfg is the run's config, "
            "for settings such as a number of repeats"
        ) from None
    return lambda num_samples, generator: train_order(num_samples, generator, cfg)


def build_val_loader(dataset: Dataset, cfg: Config, env: DistEnv, device: torch.device, **hooks) -> DataLoader:
    """`hooks`: as for build_train_loader."""
    if isinstance(dataset, IterableDataset):
        raise UsageError(
            "the validation set is a stream (an IterableDataset); evaluation needs a map-style Dataset (len() and "
            "indexing), so that every sample counts once with the same result on any number of processes: return "
            "one from build_datasets (e.g. the validation shards read into memory)"
        )
    batches = EvalBatches(len(dataset), cfg.train.eval_batch_size, env)
    return make_loader(dataset, cfg, device, hooks, batch_sampler=batches)


class RankDataLoader(DataLoader, contextlib.AbstractContextManager):
    """A DataLoader over this rank's share, whose errors this rank reports (rank 0 never saw
    them). As a context manager it ends its workers before the process group: forked after
    it, they hold its sockets, and a group torn down beside them aborted at exit (gloo's
    "state_ <= CONNECTED", 4 of 10 evaluations on 3 processes)."""

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch)

    @property
    def data_set(self):
        """The dataset data.py built, inside the wrapper that seeds it."""
        return self.dataset.dataset

    def __iter__(self):
        try:
            yield from super().__iter__()
        except UsageError as error:
            error.local = not getattr(error, "agreed", False)  # unless every rank raised it alike
            raise

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """End the worker processes now; a later iteration starts new ones."""
        iterator, self._iterator = self._iterator, None
        if hasattr(iterator, "_shutdown_workers"):  # torch's own, as its __del__ calls it
            iterator._shutdown_workers()


def make_loader(dataset, cfg: Config, device: torch.device, hooks: dict, loader=RankDataLoader, **sampling):
    """`sampling`: sampler and batch_size, or a batch_sampler (a part's `loader` may take others)."""
    workers = cfg.train.num_workers
    return loader(
        dataset,
        **{"persistent_workers": workers > 0, **sampling},  # no worker start-up cost at every epoch
        collate_fn=hooks.get("collate_fn"),  # None: torch's default_collate
        num_workers=workers,
        pin_memory=device.type == "cuda",  # pinned host memory only helps copies to a GPU
        worker_init_fn=hooks.get("worker_init_fn"),
        # Its own generator: creating an iterator must not draw from the global RNG, or
        # a resumed run's dropout would diverge from the uninterrupted run's.
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def map_leaves(obj, fn: Callable, is_leaf: Callable):
    """`obj` rebuilt with `fn(leaf)` for every value where `is_leaf(value)`; others kept."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {key: map_leaves(value, fn, is_leaf) for key, value in obj.items()}
        return mapped if type(obj) is dict else type(obj)(mapped)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_leaves(value, fn, is_leaf) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(value, fn, is_leaf) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_leaves(getattr(obj, f.name), fn, is_leaf) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def move_to_device(batch, device: torch.device, memory_format=torch.preserve_format):
    """The batch with every tensor, and anything with a `.to()`, on `device` (`memory_format`: 4-D tensors)."""

    def move(leaf):
        if isinstance(leaf, torch.Tensor):
            layout = memory_format if leaf.ndim == 4 else torch.preserve_format
            return leaf.to(device, non_blocking=True, memory_format=layout)
        return leaf.to(device)

    return map_leaves(batch, move, lambda value: callable(getattr(value, "to", None)))
