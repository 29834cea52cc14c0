"""Streaming training data: an IterableDataset read by every rank and DataLoader worker
in parts, with as many optimizer steps on every rank, and a position a resumed run
continues from.

data.py's `build_datasets` may return an IterableDataset for training (docs/streaming.md).
Its `__iter__` yields the whole stream, in the same order on every process. The run
splits it into world_size x num_workers parts, one per reader: reader k of n takes every
n-th sample from the k-th on, or, if the stream defines `split(k, n)`, that iterator
(e.g. its shards k, k + n, ...: each reader opens only its own files). If it defines
`set_epoch(epoch)`, that is called before each epoch (e.g. to shuffle its shards).

Equal steps: before each optimizer step every rank reads the step's micro-batches, and
the ranks agree (one small all-reduce) to go on only if every rank has them all. So the
epoch ends for all at once when the shortest share runs out, never with one rank waiting
at a collective the others do not reach; what the other ranks had left is not trained
that epoch, and the first such epoch says how much (each worker's last partial batch is
left out too: every micro-batch is whole).

Position: a resumed run reads and skips the micro-batches its checkpoint had trained in
the epoch (train.py's `batches_done`), so it continues with the very next one. The
stream's random augmentations draw from a generator of their own, seeded per (seed,
epoch, reader), never from the training's.
"""

import itertools

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from engine.distributed import all_gather_objects, get_world_size, is_main
from engine.errors import UsageError
from engine.logs import log
from engine.seeding import derive_seed


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
            # The reader's own RNG around each sample: with num_workers=0 the stream runs
            # in the training process, whose RNG (dropout) must not depend on it.
            caller = torch.default_generator.get_state()
            torch.default_generator.set_state(rng)
            try:
                sample = next(samples, StopIteration)
                rng = torch.default_generator.get_state()
            finally:
                torch.default_generator.set_state(caller)
            if sample is StopIteration:
                return
            yield sample


class StreamSteps:
    """A stream's micro-batches in whole optimizer steps, as many on every rank.

    `vote_group`: the CPU (gloo) group the run's votes travel on (never a wait for the
    GPU), whose timeout the run shortens to dist.step_timeout_minutes after its first
    step: a rank whose stream stops yielding fails the others' vote in that time."""

    def __init__(self, accum_steps: int, vote_group):
        self.accum_steps, self.told = accum_steps, False
        self.group = None
        if get_world_size() > 1:  # without the run's group (a script of the user's): one of its own
            self.group = vote_group if vote_group is not None else dist.new_group(backend="gloo")

    def __call__(self, batches, epoch: int, skip: int):
        for _ in range(skip):  # trained before the checkpoint this run resumed from
            next(batches, None)
        steps = 0
        while True:
            step = list(itertools.islice(batches, self.accum_steps))
            if not self.all_have(len(step) == self.accum_steps):
                self.end_epoch(epoch, steps + skip // self.accum_steps, len(step) + sum(1 for _ in batches))
                return
            steps += 1
            yield from step

    def all_have(self, have: bool) -> bool:
        """Whether every rank has its next step's micro-batches. Every rank must call this."""
        if self.group is None:
            return have
        vote = torch.tensor([int(have)])
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.group)
        return bool(vote.item())

    def end_epoch(self, epoch: int, steps: int, left: int) -> None:
        """Say how long the epoch was and, once, what the ranks had beyond the shortest
        share. Every rank must call this."""
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
