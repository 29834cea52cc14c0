"""Freezing part of the model (train.freeze), e.g. a pretrained backbone: the parameters
whose names start with one of the given prefixes get no gradient, so backward skips them
and the optimizer leaves them as they are.

For train.freeze_epochs epochs only, they are in the optimizer from the start (without a
gradient it skips them) and are unfrozen at that epoch's start. DDP decides which
parameters it all-reduces when it is built, so the model is then wrapped again.
"""

from dataclasses import dataclass

import torch.nn as nn

from engine.config import TrainConfig
from engine.errors import ConfigError


def prefixes(train: TrainConfig) -> tuple[str, ...]:
    return tuple(p.strip() for p in train.freeze.split(",") if p.strip())


def is_frozen_name(name: str, train: TrainConfig) -> bool:
    return bool(prefixes(train)) and name.startswith(prefixes(train))


def trains_later(name: str, train: TrainConfig) -> bool:
    """Frozen now, trained after train.freeze_epochs: the optimizer must hold it."""
    return train.freeze_epochs > 0 and is_frozen_name(name, train)


def frozen_at(train: TrainConfig, epoch: int) -> bool:
    return bool(prefixes(train)) and (train.freeze_epochs == 0 or epoch < train.freeze_epochs)


def set_requires_grad(model: nn.Module, train: TrainConfig, epoch: int) -> None:
    """train.freeze's parameters frozen or not, as at `epoch`. A resume sets them as when
    the checkpoint was saved before loading it: the optimizer state of frozen parameters
    is not loaded."""
    for name, parameter in model.named_parameters():
        if is_frozen_name(name, train):
            parameter.requires_grad_(not frozen_at(train, epoch))


def freeze(model: nn.Module, train: TrainConfig) -> nn.Module:
    """The model as at the first epoch; a prefix that names no parameter is an error."""
    names = [name for name, _ in model.named_parameters()]
    for prefix in prefixes(train):
        if not any(name.startswith(prefix) for name in names):
            firsts = sorted({name.split(".")[0] for name in names})
            raise ConfigError(
                f"train.freeze: {prefix!r} starts no parameter name of the model; its names start with "
                f"{', '.join(firsts[:8])}{', ...' if len(firsts) > 8 else ''} (see model.named_parameters())"
            )
    set_requires_grad(model, train, epoch=0)
    return model


@dataclass
class Freezing:
    """train.freeze over the run (not saved: it follows from the epoch)."""

    train: TrainConfig
    wrapped_frozen: bool = True  # the DDP wrapper was built with train.freeze's parameters left out

    def start_epoch(self, model: nn.Module, epoch: int) -> bool:
        """Freeze or unfreeze for `epoch`. True if the model must be wrapped again."""
        if not prefixes(self.train):
            return False
        set_requires_grad(model, self.train, epoch)
        frozen = frozen_at(self.train, epoch)
        changed, self.wrapped_frozen = frozen != self.wrapped_frozen, frozen
        return changed
