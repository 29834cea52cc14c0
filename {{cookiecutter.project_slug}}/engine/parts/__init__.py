"""Optional features of a run, each a `Part` in a module of this package.

A part module defines `build(cfg, env)`, which returns the part, or None when its settings
leave it off, and, if the part has settings, `Section`, the dataclass of its config section
(named like the module: `my_part:` in config.yaml for my_part.py). The run finds the modules present; a project
generated without a feature has no module for it, and so no section, key or hook.

The core calls a part only through the hooks of `Part` below, each a no-op by default.
"""

{% if cookiecutter.ema %}import contextlib
{% endif %}import importlib
import pkgutil
from types import ModuleType
{%- if cookiecutter.fsdp or cookiecutter.freezing %}

import torch.nn as nn
{%- endif %}


class Part:
    """An optional feature plugged into the run. Override the hooks it needs."""

    name = ""  # its config section, and its entry in checkpoints
{%- if cookiecutter.fsdp %}
    shards_model = False  # the model's tensors are split across processes (FSDP)
    saves_sharded = False  # checkpoints are folders of every rank's shards
{%- if cookiecutter.host_tuning %}
    host_allocator: dict[int, int] = {}  # glibc mallopt() settings the steps need instead of engine/host.py's
{%- endif %}

    def build_model(self, build, cfg, env, device, blocks) -> nn.Module | None:
        """The model from `build()`, placed and wrapped by the part (FSDP shards it), or
        None: built, moved and wrapped in DDP by the core."""
        return None
{%- endif %}
{%- if cookiecutter.freezing %}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as built by the task, before it is moved and wrapped."""
        return model

    def joins_later(self, model: nn.Module, steps_per_epoch: int | None) -> dict[str, int]:
        """Parameters frozen now that are trained from a later step: {name: step} (recipe.py)."""
        return {}

    def before_load(self, state, trained_epoch: int) -> None:
        """Before a checkpoint written in `trained_epoch` is loaded into the model."""
{%- endif %}
{%- if cookiecutter.ema %}

    def setup(self, state) -> None:
        """Once the run's TrainState is built (`state`), before the resume."""
{%- endif %}
{%- if cookiecutter.memory_report or cookiecutter.profiler %}

    def start(self, state) -> None:
        """After the resume, before the first step."""
{%- endif %}

    def start_epoch(self, state) -> {{ "bool" if cookiecutter.freezing else "None" }}:
        """At each epoch's start{{ "; True if the model must be wrapped again" if cookiecutter.freezing }}."""
{%- if cookiecutter.freezing %}
        return False
{%- endif %}

    def after_step(self, state) -> None:
        """After each optimizer step."""

    def after_evaluation(self, state, val_metrics: dict) -> None:
        """After each evaluation, before its checkpoint."""
{%- if cookiecutter.early_stopping %}

    def stop_reason(self, state) -> str | None:
        """Why the run ends before its last epoch, if it does."""
        return None
{%- endif %}
{%- if cookiecutter.memory_report %}

    def epoch_figures(self, state) -> dict:
        """More figures for the evaluation's row of metrics.jsonl (every rank calls this)."""
        return {}
{%- endif %}
{%- if cookiecutter.tracking %}

    # Records of the run, on rank 0 only
    def open_log(self, start_step: int) -> None:
        """When rank 0 starts its log (an error here stops every rank)."""

    def log_scalars(self, step: int, scalars: dict) -> None:
        """Every train.log_every_steps steps: train/loss, train/lr, train/samples_per_s."""

    def log_epoch(self, row: dict) -> None:
        """Each evaluation's row, as metrics.jsonl has it."""

    def close_log(self, failed: bool) -> None:
        """At the end of the run, or on its way out with an error (`failed`)."""
{%- endif %}

    # Checkpoints: small state, the same on every rank
    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass
{%- if cookiecutter.ema %}

    # A second set of the model's weights (e.g. their average), saved, loaded and evaluated
    # as the model's are, under the part's name
    holds_weights = False

    def weights(self) -> dict:
        """The part's tensors by the model's state-dict names, sharded as the model's are."""
        return {}

    def swapped_into_model(self) -> contextlib.AbstractContextManager:
        """A context in which the model holds the part's weights instead of its own."""
        return contextlib.nullcontext()

    def reset_weights(self) -> None:
        """The part's weights := the model's (a checkpoint without them, or fine-tuning)."""
{%- endif %}


def modules() -> list[ModuleType]:
    """The part modules of this project, by name."""
    names = sorted(info.name for info in pkgutil.iter_modules(__path__))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def sections() -> dict[str, type]:
    """Each part's config section class, by section name."""
    return {module.__name__.rsplit(".", 1)[-1]: module.Section for module in modules() if hasattr(module, "Section")}


def build_parts(cfg, env) -> list[Part]:
    """The parts this run's settings turn on."""
    return [part for module in modules() if (part := module.build(cfg, env)) is not None]
