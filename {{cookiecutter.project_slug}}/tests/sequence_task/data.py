"""A task unlike the example, for the tests: variable-length token sequences, padded by
`collate_fn` into a dict batch. A sequence's label: whether most of its tokens are in the
vocabulary's upper half; each token's target: whether it is."""

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from engine import check_positive

VOCAB = 16


@dataclass
class DataConfig:
    train_size: int = 2048
    val_size: int = 1009  # prime, and 4 batches of the default eval_batch_size: shares of 2/1/1 on 3 processes
    max_length: int = 24

    def __post_init__(self):
        for key in ("train_size", "val_size", "max_length"):
            check_positive(f"data.{key}", getattr(self, key))


def prepare_data(cfg) -> None:
    """Nothing to download: the data is made from the seed."""


def build_datasets(cfg):
    data = cfg.data
    return (
        Sequences(data.train_size, data.max_length, cfg.seed, "train"),
        Sequences(data.val_size, data.max_length, cfg.seed, "val"),
    )


class Sequences(Dataset):
    def __init__(self, size: int, max_length: int, seed: int, split: str):
        g = torch.Generator().manual_seed(seed * 2 + (split == "val") + 1)
        self.lengths = torch.randint(3, max_length + 1, (size,), generator=g)
        self.tokens = torch.randint(VOCAB, (size, max_length), generator=g)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, index):
        tokens = self.tokens[index, : self.lengths[index]].clone()
        upper = (tokens >= VOCAB // 2).float()
        return {"tokens": tokens, "upper": upper, "label": (upper.mean() > 0.5).float()}


def collate_fn(samples: list[dict]) -> dict:
    """Pads every sequence to the batch's longest: a sample's padding depends on its batch-mates."""
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.long)
    upper = torch.zeros(len(samples), longest)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = len(sample["tokens"])
        tokens[row, :n], upper[row, :n], mask[row, :n] = sample["tokens"], sample["upper"], True
    labels = torch.stack([s["label"] for s in samples])
    return {"tokens": tokens, "upper": upper, "mask": mask, "label": labels}
