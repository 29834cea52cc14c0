"""A task that is not classification, for the tests: regress two targets from 8 numbers.

Samples are dicts; `collate_fn` makes a dataclass batch holding a dict and a namedtuple,
so the machinery has to move a nested structure to the device.
"""

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from engine import check_positive

Targets = namedtuple("Targets", ["main", "aux"])


@dataclass
class DataConfig:
    train_size: int = 512
    val_size: int = 97  # prime: shards of different lengths on 2 and 3 processes
    features: int = 8
    noise: float = 0.05  # standard deviation of the targets' noise

    def __post_init__(self):
        for key in ("train_size", "val_size", "features"):
            check_positive(f"data.{key}", getattr(self, key))


@dataclass
class Batch:
    inputs: dict  # {"x": [N, features]}
    targets: Targets  # main [N], aux [N]


def prepare_data(cfg) -> None:
    """Nothing to download: the data is made from the seed."""


def build_datasets(cfg):
    data = cfg.data
    return (
        Points(data.train_size, data.features, data.noise, cfg.seed, "train"),
        Points(data.val_size, data.features, data.noise, cfg.seed, "val"),
    )


class Points(Dataset):
    """x ~ N(0, 1); main = a fixed linear map of x, aux = |x_0|, both with noise."""

    def __init__(self, size, features, noise, seed, split):
        weights = torch.randn(features, generator=torch.Generator().manual_seed(seed)) / features**0.5
        g = torch.Generator().manual_seed(seed * 2 + (split == "val") + 1)
        self.x = torch.randn(size, features, generator=g)
        self.main = self.x @ weights + noise * torch.randn(size, generator=g)
        self.aux = self.x[:, 0].abs() + noise * torch.randn(size, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index].clone(), "main": self.main[index].clone(), "aux": self.aux[index].clone()}


def collate_fn(samples: list[dict]) -> Batch:
    stack = lambda key: torch.stack([s[key] for s in samples])  # noqa: E731
    return Batch(inputs={"x": stack("x")}, targets=Targets(main=stack("main"), aux=stack("aux")))
