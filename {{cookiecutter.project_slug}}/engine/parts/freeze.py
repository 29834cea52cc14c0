"""Freezing part of the model, e.g. a pretrained backbone: the parameters whose names start
with one of freeze.params' prefixes get no gradient, so backward skips them and the
optimizer leaves them as they are.

For freeze.epochs epochs only, they are in the optimizer from the start (without a
gradient it skips them; recipe.py gets them as `joins_later`) and are unfrozen at that
epoch's start. DDP decides which parameters it all-reduces when it is built, so the model
is then wrapped again.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch.nn as nn

from engine.config import check_positive
from engine.distributed import is_main
from engine.errors import ConfigError
from engine.logs import log
from engine.parts import Part


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
    if not cfg.freeze.prefixes:
        return None
{%- if cookiecutter.fsdp %}
    if cfg.freeze.epochs and cfg.fsdp.enabled:
        # FSDP fixes which parameters take gradients when it shards the model.
        raise ConfigError("freeze.epochs needs DDP (fsdp.enabled=false); under FSDP, freeze for the whole run")
{%- endif %}
    return Freezing(cfg.freeze)


class Freezing(Part):
    name = "freeze"

    def __init__(self, section: Section):
        self.prefixes, self.epochs = section.prefixes, section.epochs
        self.wrapped_frozen = True  # the DDP wrapper was built with the frozen parameters left out

    def is_frozen_name(self, name: str) -> bool:
        return name.startswith(self.prefixes)

    def frozen_at(self, epoch: int) -> bool:
        return self.epochs == 0 or epoch < self.epochs

    def set_requires_grad(self, model: nn.Module, epoch: int) -> None:
        """The parameters frozen or not, as at `epoch`."""
        for name, parameter in model.named_parameters():
            if self.is_frozen_name(name):
                parameter.requires_grad_(not self.frozen_at(epoch))

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as at the first epoch; a prefix that names no parameter is an error."""
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
        if not self.epochs:
            return {}
        if steps_per_epoch is None:
            raise ConfigError("freeze.epochs counts epochs, which a stream has no length for; freeze for the whole run")
        first_step = self.epochs * steps_per_epoch
        return {name: first_step for name, _ in model.named_parameters() if self.is_frozen_name(name)}

    def before_load(self, state, trained_epoch: int) -> None:
        # As in the checkpoint's last step: the optimizer loads state for the parameters
        # that needed gradients then.
        self.set_requires_grad(state.model, trained_epoch)

    def start_epoch(self, state) -> bool:
        self.set_requires_grad(state.model, state.epoch)
        frozen = self.frozen_at(state.epoch)
        changed, self.wrapped_frozen = frozen != self.wrapped_frozen, frozen
        if changed and not frozen and is_main():
            log(f"epoch {state.epoch}: the parameters of freeze.params are trained from here on")
        return changed
