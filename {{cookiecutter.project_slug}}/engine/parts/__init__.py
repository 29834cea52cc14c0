"""Optional features of a run, each a `Part` in a module of this package: `build(cfg, env)`
returns the part (None when its settings leave it off), and `Section`, if it has settings,
is the dataclass of its config section, named like the module (`my_part:` for my_part.py).
A project generated without a feature has no module for it, so no section, key or hook."""

import importlib
import pkgutil
{%- if cookiecutter.freezing or cookiecutter.fsdp %}

import torch.nn as nn
{%- endif %}


class Part:
    """An optional feature plugged into the run. The core calls it only through these
    hooks; it overrides those it needs, each a no-op returning None unless said otherwise:
{%- if cookiecutter.fsdp %}
    - build_model(build, cfg, env, device, blocks): the model from `build()`, placed and
      wrapped by the part (FSDP shards it), or None: built, moved and wrapped in DDP by the core
{%- endif %}
{%- if cookiecutter.freezing %}
    - prepare_model(model): the model as built by the task, before it is moved and wrapped
    - joins_later(model, steps_per_epoch): {name: step} of parameters frozen now that train
      from a later step (recipe.py)
    - before_load(state, trained_epoch): before a checkpoint written in that epoch is loaded
{%- endif %}
{%- if cookiecutter.ema %}
    - setup(state): once the run's TrainState is built, before the resume
{%- endif %}
{%- if cookiecutter.memory_report or cookiecutter.profiler %}
    - start(state): after the resume, before the first step
{%- endif %}
    - start_epoch(state): at each epoch's start{{ "; True if the model must be wrapped again" if cookiecutter.freezing }}
    - after_step(state): after each optimizer step
    - after_evaluation(state, val_metrics): after each evaluation, before its checkpoint
{%- if cookiecutter.early_stopping %}
    - stop_reason(state): why the run ends before its last epoch, if it does
{%- endif %}
{%- if cookiecutter.memory_report %}
    - epoch_figures(state): more figures for the evaluation's row of metrics.jsonl (every rank)
{%- endif %}
{%- if cookiecutter.tracking %}
    - on rank 0, records of the run: open_log(start_step) as its log starts (an error there
      stops every rank), log_scalars(step, scalars) every train.log_every_steps steps,
      log_epoch(row) with each row of metrics.jsonl, close_log(failed) at the end
{%- endif %}
    - state_dict(), load_state_dict(state): small state for checkpoints, the same on every rank
{%- if cookiecutter.ema %}
    - with holds_weights, a second set of the model's weights (e.g. their average), saved,
      loaded and evaluated as the model's are, under the part's name: weights(), by the
      model's state-dict names and sharded as the model's are; swapped_into_model(), a
      context in which the model holds them; reset_weights(), to the model's
{%- endif %}
    """

    name = ""  # its config section, and its entry in checkpoints
{%- if cookiecutter.fsdp %}
    shards_model = False  # the model's tensors are split across processes (FSDP)
    saves_sharded = False  # checkpoints are folders of every rank's shards
{%- if cookiecutter.host_tuning %}
    host_allocator: dict[int, int] = {}  # glibc mallopt() settings the steps need instead of engine/host.py's
{%- endif %}
{%- endif %}
{%- if cookiecutter.ema %}
    holds_weights = False
{%- endif %}

    # The hooks, each doing nothing unless a part overrides it (what each is for: above).
{%- if cookiecutter.fsdp %}
    def build_model(self, build, cfg, env, device, blocks) -> nn.Module | None: ...
{%- endif %}
{%- if cookiecutter.freezing %}
    def before_load(self, state, trained_epoch: int) -> None: ...
{%- endif %}
{%- if cookiecutter.ema %}
    def setup(self, state) -> None: ...
{%- endif %}
{%- if cookiecutter.memory_report or cookiecutter.profiler %}
    def start(self, state) -> None: ...
{%- endif %}
{%- if not cookiecutter.freezing %}
    def start_epoch(self, state) -> None: ...
{%- endif %}
    def after_step(self, state) -> None: ...
    def after_evaluation(self, state, val_metrics: dict) -> None: ...
{%- if cookiecutter.early_stopping %}
    def stop_reason(self, state) -> str | None: ...
{%- endif %}
    def state_dict(self) -> dict | None: ...
    def load_state_dict(self, state: dict) -> None: ...
{%- if cookiecutter.ema %}
    def weights(self) -> dict: ...
    def swapped_into_model(self): ...
    def reset_weights(self) -> None: ...
{%- endif %}
{%- if cookiecutter.tracking %}
    def open_log(self, start_step: int) -> None: ...
    def log_scalars(self, step: int, scalars: dict) -> None: ...
    def log_epoch(self, row: dict) -> None: ...
    def close_log(self, failed: bool) -> None: ...
{%- endif %}
{%- if cookiecutter.freezing %}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model

    def joins_later(self, model: nn.Module, steps_per_epoch: int | None) -> dict[str, int]:
        return {}

    def start_epoch(self, state) -> bool:
        return False
{%- endif %}
{%- if cookiecutter.memory_report %}

    def epoch_figures(self, state) -> dict:
        return {}
{%- endif %}


def modules() -> list:
    """The part modules of this project, by name."""
    return [importlib.import_module(f"{__name__}.{n}") for n in sorted(m.name for m in pkgutil.iter_modules(__path__))]


def sections() -> dict[str, type]:
    """Each part's config section class, by section name."""
    return {module.__name__.rsplit(".", 1)[-1]: module.Section for module in modules() if hasattr(module, "Section")}


def build_parts(cfg, env) -> list[Part]:
    """The parts this run's settings turn on."""
    return [part for module in modules() if (part := module.build(cfg, env)) is not None]
