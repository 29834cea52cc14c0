"""Optional features of a run, each a `Part` in a module of this package: `build(cfg, env)`
returns the part (None when its settings leave it off), and `Section`, if it has settings,
is the dataclass of its config section, named like the module (`my_part:` for my_part.py).
A project generated without a feature has no module for it, so no section or key."""

import importlib
import pkgutil

import torch.nn as nn


class Part:
    """An optional feature plugged into the run. The core calls each part through these hooks
    alone, the same in every project; each returns None ("nothing to change") unless a part
    overrides it. `state` is the run's TrainState."""

    name = ""  # its config section, and its entry in checkpoints
    shards_model = False  # the model's tensors are split across processes
    saves_sharded = False  # checkpoints are folders of every rank's shards
    holds_weights = False  # a second set of weights (e.g. their average), saved, loaded and evaluated as the model's

    def process_group_env(self, env) -> dict[str, str] | None: ...  # variables for the process group (launched)
    def build_model(self, build, cfg, env, device, blocks) -> nn.Module | None: ...  # built, placed and wrapped
    def prepare_model(self, model: nn.Module) -> nn.Module | None: ...  # as the task built it, before it is moved
    def joins_later(self, model, steps_per_epoch) -> dict[str, int] | None: ...  # {name: step} held back until then
    def before_load(self, state, trained_epoch: int) -> None: ...  # before a checkpoint of that epoch loads
    def setup(self, state) -> None: ...  # once the TrainState is built, before the resume
    def start(self, state) -> None: ...  # after the resume, before the first step
    def start_epoch(self, state) -> bool | None: ...  # at each epoch's start; True: wrap the model again
    def after_step(self, state) -> None: ...  # after each optimizer step
    def after_evaluation(self, state, val_metrics: dict) -> None: ...  # after each evaluation, before its checkpoint
    def stop_reason(self, state) -> str | None: ...  # why the run ends before its last epoch, if it does
    def epoch_figures(self, state) -> dict | None: ...  # more for the evaluation's row of metrics.jsonl (every rank)
    def state_dict(self) -> dict | None: ...  # small state for checkpoints, the same on every rank
    def load_state_dict(self, state: dict) -> None: ...
    def weights(self) -> dict: ...  # with holds_weights: by the model's state-dict names, sharded as its are
    def swapped_into_model(self): ...  # with holds_weights: a context in which the model holds them
    def reset_weights(self) -> None: ...  # with holds_weights: to the model's

    # On rank 0, a record of the run (an error as it opens stops every rank): each row of metrics.jsonl.
    def open_log(self, start_step: int) -> None: ...
    def log_scalars(self, step: int, scalars: dict) -> None: ...
    def log_epoch(self, row: dict) -> None: ...
    def close_log(self, failed: bool) -> None: ...

    def lost_peer(self, error: BaseException) -> None: ...  # as the process group is left (error.add_note: its line)


def modules() -> list:
    """The part modules of this project, by name."""
    return [importlib.import_module(f"{__name__}.{n}") for n in sorted(m.name for m in pkgutil.iter_modules(__path__))]


def sections() -> dict[str, type]:
    """Each part's config section class, by section name."""
    return {module.__name__.rsplit(".", 1)[-1]: module.Section for module in modules() if hasattr(module, "Section")}


def build_parts(cfg, env) -> list[Part]:
    """The parts this run's settings turn on."""
    return [part for module in modules() if (part := module.build(cfg, env)) is not None]
