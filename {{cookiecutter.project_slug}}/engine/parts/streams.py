"""A training set that is a stream (an IterableDataset, docs/streaming.md), read in
world_size x num_workers parts: reader k of n takes every n-th sample from the k-th, or the
stream's own `split(k, n)`. Before each step the ranks vote to go on only if all have the
step's micro-batches, so the epoch ends for all at once, never with one rank waiting at a
collective. A resumed run skips the micro-batches its checkpoint trained; each reader's RNG
is its own."""

import itertools

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from engine.distributed import all_gather_objects, get_world_size, is_main, vote
from engine.errors import UsageError
from engine.hooks import Part
from engine.loader import RankDataLoader, make_loader
from engine.logs import log
from engine.seeding import borrowed_rng, derive_seed


def build(cfg, env) -> "Streams":
    return Streams(cfg, env)


class Streams(Part):
    name = "streams"

    def __init__(self, cfg, env):
        self.cfg, self.rank, self.world_size = cfg, env.rank, env.world_size

    def train_loader(self, dataset, device, hooks: dict, vote_group):
        if not isinstance(dataset, IterableDataset):
            return None
        if not self.cfg.train.max_steps:
            raise UsageError(
                "the training set is a stream (an IterableDataset), which has no length to count epochs in; "
                "set train.max_steps, the run's length in optimizer steps"
            )
        if hooks.get("train_order"):
            raise UsageError("data.py's train_order orders a training set with a length; a stream orders itself")
        stream = StreamParts(dataset, self.rank, self.world_size, self.cfg.seed)
        # Its workers start anew each epoch (not persistent), with the epoch the stream is set to.
        sampling = {"batch_size": self.cfg.train.batch_size, "drop_last": True, "persistent_workers": False}
        loader = make_loader(stream, self.cfg, device, hooks, StreamLoader, **sampling)
        loader.accum_steps = self.cfg.train.accum_steps
        if get_world_size() > 1:  # without the run's group (a script of the user's): one of its own
            loader.group = vote_group if vote_group is not None else dist.new_group(backend="gloo")
        return loader


class StreamLoader(RankDataLoader):
    """A stream's micro-batches in whole optimizer steps, as many on every rank. The votes go
    on `group` (gloo), bounded by dist.step_timeout_minutes after the first step."""

    accum_steps, group = 1, None  # Streams.train_loader's
    start_batch, batches, told = 0, None, False

    @property
    def data_set(self):
        return self.dataset.stream

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
