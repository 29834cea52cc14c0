"""A streamed task for the tests: the regression task's points, read from a folder of
shards (docs/streaming.md), with a random augmentation.

Each shard is a torch.save file of {"x": [N, features], "main": [N], "aux": [N]};
`write_shards` makes them. The validation set, val-*.pt, is read into memory: map-style.
"""

import random
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset

from engine import ConfigError, check_positive

Targets = namedtuple("Targets", ["main", "aux"])


@dataclass
class DataConfig:
    shards: str = "shards"  # a folder of *.pt shards, read in name order
    features: int = 8
    jitter: float = 0.01  # standard deviation of the noise added to x on reading: a random augmentation

    def __post_init__(self):
        check_positive("data.features", self.features)


@dataclass
class Batch:
    inputs: dict
    targets: Targets


def prepare_data(cfg) -> None:
    """The test writes the shards."""


def build_datasets(cfg):
    folder = Path(cfg.data.shards)
    files = sorted(folder.glob("train-*.pt"))
    if not files:
        raise ConfigError(f"data.shards: no train-*.pt shards in {str(folder)!r}")
    return ShardStream(files, cfg.seed, cfg.data.jitter), ShardsInMemory(sorted(folder.glob("val-*.pt")))


class ShardStream(IterableDataset):
    """Samples of a list of shard files, the shards in an order shuffled per epoch."""

    def __init__(self, files: list[Path], seed: int, jitter: float):
        self.files, self.seed, self.jitter = files, seed, jitter
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # called by the run before each epoch
        self.epoch = epoch

    def shards(self) -> list[Path]:
        order = list(self.files)
        random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        return order

    def split(self, part: int, parts: int):  # called by the run: reader `part` of `parts` reads its own shards
        return self.samples(self.shards()[part::parts])

    def __iter__(self):
        return self.samples(self.shards())

    def samples(self, files: list[Path]):
        for path in files:
            shard = torch.load(path, weights_only=True)
            for i in range(len(shard["x"])):
                x = shard["x"][i] + self.jitter * torch.randn(shard["x"].shape[1])
                yield {"x": x, "main": shard["main"][i], "aux": shard["aux"][i]}


def write_shards(folder: Path, sizes: list[int], val_size: int = 97, features: int = 8, seed: int = 0) -> None:
    """train-*.pt shards of `sizes` samples, and one val-000.pt of `val_size`."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = torch.randn(features, generator=torch.Generator().manual_seed(seed)) / features**0.5
    names = [f"train-{k:03d}.pt" for k in range(len(sizes))] + ["val-000.pt"]
    for k, (name, size) in enumerate(zip(names, [*sizes, val_size], strict=True)):
        g = torch.Generator().manual_seed(seed * 100 + k + 1)
        x = torch.randn(size, features, generator=g)
        main = x @ weights + 0.05 * torch.randn(size, generator=g)
        torch.save({"x": x, "main": main, "aux": x[:, 0].abs()}, folder / name)


class ShardsInMemory(Dataset):
    """Shards read whole into memory: a map-style dataset, as evaluation needs."""

    def __init__(self, files: list[Path]):
        shards = [torch.load(path, weights_only=True) for path in files]
        self.columns = {key: torch.cat([shard[key] for shard in shards]) for key in ("x", "main", "aux")}

    def __len__(self):
        return len(self.columns["x"])

    def __getitem__(self, index):
        return {key: column[index].clone() for key, column in self.columns.items()}


def collate_fn(samples: list[dict]) -> Batch:
    return Batch(
        inputs={"x": torch.stack([s["x"] for s in samples])},
        targets=Targets(*(torch.stack([s[key] for s in samples]) for key in Targets._fields)),
    )
