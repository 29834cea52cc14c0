"""Samplers and DataLoaders: how samples reach each rank, in which order.

Training: one permutation per epoch (DistributedSampler, seeded, `set_epoch`), rank r taking
every world_size-th index, so step s sees the same samples at any world size with the same
effective batch. Whole optimizer steps only: an epoch's tail short of one is left out.
Evaluation: fixed batches in dataset order, dealt whole to ranks: every sample once, no
padding, the same batches on any number of processes. A batch may be any nesting of
tensors in lists, tuples, dicts, namedtuples and dataclasses (`move_to_device`).

A stream (an IterableDataset, docs/streaming.md) is read in world_size x num_workers parts:
reader k of n takes every n-th sample from the k-th, or the stream's own `split(k, n)`.
Before each step the ranks vote to go on only if all have the step's micro-batches, so the
epoch ends for all at once, never with one rank waiting at a collective. A resumed run
skips the micro-batches its checkpoint trained; each reader's RNG is its own.
"""

import collections
import contextlib
import dataclasses
import inspect
import itertools
import numbers
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info

from engine.config import Config, effective_batch
from engine.distributed import DistEnv, agreed, all_gather_objects, get_world_size, is_main, vote
from engine.errors import UsageError
from engine.logs import log
from engine.seeding import borrowed_rng, derive_seed, sample_seeds


class TrainSampler(DistributedSampler):
    """DistributedSampler drawing exactly `num_batches` batches, from `start_batch` on, as
    (sample seed, index): the seed depends on (seed, epoch, index) only. `order`: data.py's
    `train_order`, the epoch's indices over all ranks in place of the permutation (the n-th
    repeat of an index seeded as index + n x size)."""

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
    """Optimizer steps per epoch; None for a stream, whose length shows only at its end."""
    return None if isinstance(train_loader, StreamLoader) else train_loader.sampler.num_batches // cfg.train.accum_steps


def build_train_loader(
    dataset: Dataset, cfg: Config, env: DistEnv, device: torch.device, vote_group=None, **hooks
) -> DataLoader:
    """`hooks`: collate_fn, worker_init_fn and train_order (data.py's); a stream's ranks vote
    on `vote_group`."""
    if isinstance(dataset, IterableDataset):
        if not cfg.train.max_steps:
            raise UsageError(
                "the training set is a stream (an IterableDataset), which has no length to count epochs in; "
                "set train.max_steps, the run's length in optimizer steps"
            )
        if hooks.get("train_order"):
            raise UsageError("data.py's train_order orders a training set with a length; a stream orders itself")
        stream = StreamParts(dataset, env.rank, env.world_size, cfg.seed)
        loader = make_loader(stream, cfg, device, hooks, batch_size=cfg.train.batch_size, drop_last=True)
        loader.accum_steps = cfg.train.accum_steps
        if get_world_size() > 1:  # without the run's group (a script of the user's): one of its own
            loader.group = vote_group if vote_group is not None else dist.new_group(backend="gloo")
        return loader
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
        """The dataset data.py built, inside the wrapper that seeds or splits it."""
        return self.dataset.stream if isinstance(self.dataset, StreamParts) else self.dataset.dataset

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


class StreamLoader(RankDataLoader):
    """A stream's micro-batches in whole optimizer steps, as many on every rank. The votes go
    on `group` (gloo), bounded by dist.step_timeout_minutes after the first step."""

    accum_steps, group = 1, None  # build_train_loader's
    start_batch, batches, told = 0, None, False

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.dataset.set_epoch(epoch)
        self.start_batch = start_batch
        self.generator.manual_seed(derive_seed(self.dataset.seed, self.dataset.rank, epoch))  # workers' own seeds

    def __iter__(self):
        self.batches = self.whole_steps(super().__iter__(), self.dataset.epoch, self.start_batch)
        return self.batches

    def close(self) -> None:
        if self.batches is not None:  # its workers end with it
            self.batches.close()
        super().close()

    def whole_steps(self, batches, epoch: int, skip: int):
        for _ in range(skip):  # trained before the checkpoint this run resumed from
            next(batches, None)
        for steps in itertools.count():  # whole steps given so far
            step = list(itertools.islice(batches, self.accum_steps))
            if not vote([float(len(step) == self.accum_steps)], "min", self.group)[0]:  # every rank has the step
                self.end_epoch(epoch, steps + skip // self.accum_steps, len(step) + sum(1 for _ in batches))
                return
            yield from step

    def end_epoch(self, epoch: int, steps: int, left: int) -> None:
        """Say how long the epoch was and, once, what ranks had beyond the shortest share."""
        left_over = all_gather_objects(left)
        if steps == 0:
            raise UsageError(
                f"the training stream gave a rank no whole optimizer step in epoch {epoch} (micro-batches per rank: "
                f"{left_over}); give it more samples, or lower train.batch_size or train.accum_steps"
            )
        if not is_main():
            return
        line = f"epoch {epoch} of the stream: {steps} steps on every rank"
        if any(left_over) and not self.told:
            self.told = True
            per_rank = ", ".join(f"{n} on rank {rank}" for rank, n in enumerate(left_over))
            line += (
                f", as many as the shortest share has; micro-batches left out: {per_rank} (and each DataLoader "
                "worker's last partial batch); a stream split into more, evener parts loses less"
            )
        log(line)


def make_loader(dataset, cfg: Config, device: torch.device, hooks: dict, **sampling) -> DataLoader:
    """`sampling`: sampler and batch_size, a batch_sampler, or (a stream) batch_size and drop_last."""
    workers, stream = cfg.train.num_workers, isinstance(dataset, StreamParts)
    return (StreamLoader if stream else RankDataLoader)(
        dataset,
        **sampling,
        collate_fn=hooks.get("collate_fn"),  # None: torch's default_collate
        num_workers=workers,
        pin_memory=device.type == "cuda",  # pinned host memory only helps copies to a GPU
        # No worker start-up cost at every epoch; but a stream's workers start anew, with
        # the epoch it is set to.
        persistent_workers=workers > 0 and not stream,
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


class StreamParts(IterableDataset):
    """This rank's share of a stream; in a DataLoader worker, that worker's part of it."""

    def __init__(self, stream: IterableDataset, rank: int, world_size: int, seed: int):
        self.stream, self.rank, self.world_size, self.seed = stream, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.stream, "set_epoch", None)):
            self.stream.set_epoch(epoch)

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        part, parts = self.rank * workers + worker_id, self.world_size * workers
        split = getattr(self.stream, "split", None)
        samples = iter(split(part, parts)) if callable(split) else itertools.islice(self.stream, part, None, parts)
        rng = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, part)).get_state()
        while True:
            # The reader's own RNG: with num_workers=0 the training's (dropout) is around it.
            with borrowed_rng(cpu_generator_only=True) as generator:
                generator.set_state(rng)
                sample = next(samples, StopIteration)
                rng = generator.get_state()
            if sample is StopIteration:
                return
            yield sample
