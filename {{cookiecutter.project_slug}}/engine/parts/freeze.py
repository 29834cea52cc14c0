"""Freezing the parameters under freeze.params' prefixes, e.g. a pretrained backbone; with freeze.epochs, only
that long: the model is then wrapped again, since DDP fixes which parameters it all-reduces when built."""

from dataclasses import dataclass
from typing import ClassVar

import torch.nn as nn

from engine.config import check_positive
from engine.distributed import is_main
from engine.errors import ConfigError
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {"train.freeze": "freeze.params", "train.freeze_epochs": "freeze.epochs"}


@dataclass
class Section:
    params: str = ""  # comma-separated name prefixes of parameters that get no gradient (e.g. conv1,layer1)
    epochs: int = 0  # freeze only for this many epochs (ddp); 0 = for the whole run

    fixed_on_resume: ClassVar[bool] = True  # they shape the optimizer

    def __post_init__(self):
        check_positive("freeze.epochs", self.epochs, allow_zero=True)
        if self.epochs and not self.prefixes:
            raise ConfigError("freeze.epochs is set but freeze.params names no parameters; set both or neither")

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.params.split(",") if p.strip())


def build(cfg, env) -> "Freezing | None":
    sharding = getattr(cfg, "fsdp", None)  # the fsdp part's section, in a project that has it
    if cfg.freeze.epochs and sharding and sharding.enabled:  # FSDP fixes which parameters take gradients
        raise ConfigError("freeze.epochs needs DDP (fsdp.enabled=false); under FSDP, freeze for the whole run")
    return Freezing(cfg.freeze) if cfg.freeze.prefixes else None


class Freezing(Part):
    name = "freeze"

    def __init__(self, section: Section):
        self.prefixes, self.epochs = section.prefixes, section.epochs
        self.wrapped_frozen = True  # the DDP wrapper was built with the frozen parameters left out

    def set_requires_grad(self, model: nn.Module, epoch: int) -> bool:
        """The parameters frozen or not as at `epoch`; whether frozen."""
        frozen = self.epochs == 0 or epoch < self.epochs
        for name, parameter in model.named_parameters():
            if name.startswith(self.prefixes):
                parameter.requires_grad_(not frozen)
        return frozen

    def prepare_model(self, model: nn.Module) -> nn.Module:
        names = [name for name, _ in model.named_parameters()]
        for prefix in self.prefixes:
            if not any(name.startswith(prefix) for name in names):
                firsts = sorted({name.split(".")[0] for name in names})
                raise ConfigError(
                    f"freeze.params: {prefix!r} starts no parameter name of the model; its names start with "
                    f"{', '.join(firsts[:8])}{', ...' if len(firsts) > 8 else ''} (see model.named_parameters())"
                )
        self.set_requires_grad(model, epoch=0)
        return model

    def joins_later(self, model: nn.Module, steps_per_epoch: int | None) -> dict[str, int]:
        if self.epochs and steps_per_epoch is None:
            raise ConfigError("freeze.epochs counts epochs, which a stream has no length for; freeze for the whole run")
        names = [name for name, _ in model.named_parameters() if name.startswith(self.prefixes)]
        return dict.fromkeys(names, self.epochs * steps_per_epoch) if self.epochs else {}

    def before_load(self, state, trained_epoch: int) -> None:
        # The optimizer loads state for the parameters that needed gradients at the checkpoint's step.
        self.set_requires_grad(state.model, trained_epoch)

    def start_epoch(self, state) -> bool:
        frozen = self.set_requires_grad(state.model, state.epoch)
        changed, self.wrapped_frozen = frozen != self.wrapped_frozen, frozen
        if changed and not frozen and is_main():
            log(f"epoch {state.epoch}: the parameters of freeze.params are trained from here on")
        return changed
