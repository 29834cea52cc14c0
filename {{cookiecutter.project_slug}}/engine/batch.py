"""Batches of any structure: tensors, and lists, tuples, dicts, namedtuples and
dataclasses of them, nested to any depth."""

import dataclasses
from collections.abc import Callable, Mapping

import torch


def map_leaves(obj, fn: Callable, is_leaf: Callable):
    """`obj` rebuilt with `fn(leaf)` in place of every value where `is_leaf(value)`; other
    values (numbers, strings, None) stay as they are."""
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
    """The batch with every tensor on `device`, and any other object with a `.to()`
    (e.g. a tokenizer's output) moved by it. `memory_format` applies to 4-D tensors."""

    def move(leaf):
        if isinstance(leaf, torch.Tensor):
            layout = memory_format if leaf.ndim == 4 else torch.preserve_format
            return leaf.to(device, non_blocking=True, memory_format=layout)
        return leaf.to(device)

    return map_leaves(batch, move, has_to)


def has_to(value) -> bool:
    return isinstance(value, torch.Tensor) or callable(getattr(value, "to", None))
