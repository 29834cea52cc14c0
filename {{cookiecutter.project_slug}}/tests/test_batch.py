"""Batches of any structure reach the device whole."""

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch

from engine.loader import move_to_device

META = torch.device("meta")  # a real second device on any machine: tensors there have no data
Pair = namedtuple("Pair", ["left", "right"])


@dataclass
class Batch:
    images: torch.Tensor
    targets: list
    name: str = "batch"


class Tokens:
    """An object with its own .to(), as a tokenizer's output has."""

    def __init__(self):
        self.moved_to = None

    def to(self, device):
        self.moved_to = device
        return self


def devices(obj) -> list:
    found = []
    if isinstance(obj, torch.Tensor):
        return [obj.device]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, Batch):
        obj = [obj.images, obj.targets]
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found += devices(item)
    return found


def test_every_tensor_of_a_nested_batch_moves_and_the_structure_stays():
    batch = Batch(
        images=torch.ones(2, 3, 4, 4),
        targets=[{"boxes": torch.zeros(1, 4), "labels": torch.tensor([1])}, {"boxes": torch.zeros(0, 4), "id": 7}],
    )
    structures = [
        torch.ones(3),
        [torch.ones(1), (torch.ones(2), "text", 3)],
        OrderedDict(a=torch.ones(1), b=Pair(torch.ones(1), torch.ones(2))),
        batch,
    ]
    for structure in structures:
        moved = move_to_device(structure, META)
        assert type(moved) is type(structure)
        assert devices(moved) and all(device == META for device in devices(moved)), structure
    moved = move_to_device(batch, META)
    assert moved.name == "batch" and moved.targets[1]["id"] == 7 and batch.images.device.type == "cpu"
    assert isinstance(move_to_device(structures[2], META)["b"], Pair)


def test_objects_with_their_own_to_are_moved_by_it():
    tokens = Tokens()
    assert move_to_device({"tokens": tokens}, META)["tokens"].moved_to == META


def test_channels_last_applies_to_image_batches_only():
    batch = {"images": torch.ones(2, 3, 4, 4), "labels": torch.ones(2)}
    moved = move_to_device(batch, torch.device("cpu"), memory_format=torch.channels_last)
    assert moved["images"].is_contiguous(memory_format=torch.channels_last)
    assert not batch["images"].is_contiguous(memory_format=torch.channels_last)
    assert moved["labels"].shape == (2,)
