"""The one set of hooks through which the core reaches the optional features of a run (the
modules of engine/parts), and their discovery. Each part module has `build(cfg, env)`,
which returns its `Part` (None when its settings leave it off), and `Section`, if it has
settings: the dataclass of its config section, named like the module (`my_part:` for
my_part.py). A module may also say where its keys were before (`MOVED_KEYS`, engine/config.py
reads it) and word an error a process ends with (`error_line(error)`: engine/logs.py asks it
of the MemoryError and RuntimeError it turns into one line). A project generated without a
feature has no module for it, so no section or key."""

import importlib
import pkgutil
from pathlib import Path

import torch.nn as nn


class Part:
    """An optional feature plugged into the run. The core calls each part through these hooks
    alone, the same in every project; each returns None ("nothing to change") unless a part
    overrides it. `state` is the run's TrainState."""

    name = ""  # its config section, and its entry in checkpoints
    shards_model = False  # the model's tensors are split across processes
    saves_sharded = False  # checkpoints are folders of every rank's shards
    holds_weights = False  # a second set of weights (e.g. their average), saved, loaded and evaluated as the model's
    measures_steps = False  # measures each micro-batch's forward and backward (measure), for the train figures

    def process_group_env(self, env) -> dict[str, str] | None: ...  # variables for the process group (launched)
    def output_dir_held(self, output_dir: str) -> None: ...  # on rank 0, once this run holds it, before writing there
    def build_model(self, build, cfg, env, device, blocks) -> nn.Module | None: ...  # built, placed and wrapped
    def prepare_model(self, model: nn.Module) -> nn.Module | None: ...  # as the task built it, before it is moved
    def train_loader(self, dataset, device, hooks: dict, vote_group): ...  # a loader, if the part reads its kind
    def joins_later(self, model, steps_per_epoch) -> dict[str, int] | None: ...  # {name: step} held back until then
    def before_load(self, state, trained_epoch: int) -> None: ...  # before a checkpoint of that epoch loads
    def after_load(self, state, path, ckpt: dict, resumed: bool) -> None: ...  # after the model's (else init_from's)
    def setup(self, state) -> None: ...  # once the TrainState is built, before the resume
    def start(self, state) -> None: ...  # after the resume, before the first step
    def start_epoch(self, state) -> bool | None: ...  # at each epoch's start; True: wrap the model again
    def after_step(self, state) -> None: ...  # after each optimizer step
    def after_evaluation(self, state, val_metrics: dict) -> None: ...  # after each evaluation, before its checkpoint
    def stop_reason(self, state) -> str | None: ...  # why the run ends before its last epoch, if it does
    def epoch_figures(self, state) -> dict | None: ...  # more for the evaluation's row of metrics.jsonl (every rank)
    def measure(self, batch): ...  # with measures_steps: a context around a micro-batch's forward and backward
    def train_figures(self, micro_batches: int, elapsed: float) -> dict: ...  # with measures_steps (every rank)
    def reset_figures(self) -> None: ...  # with measures_steps: a new stretch of training starts
    def state_dict(self) -> dict | None: ...  # small state for checkpoints, the same on every rank
    def load_state_dict(self, state: dict) -> None: ...
    def weights(self) -> dict: ...  # with holds_weights: by the model's state-dict names, sharded as its are
    def swapped_into_model(self): ...  # with holds_weights: a context in which the model holds them

    # On rank 0, a record of the run (an error as it opens stops every rank): each row of metrics.jsonl.
    def config_header(self) -> str | None: ...  # comment lines atop the saved config.yaml
    def open_log(self, start_step: int) -> None: ...
    def log_scalars(self, step: int, scalars: dict) -> None: ...
    def log_epoch(self, row: dict) -> None: ...
    def close_log(self, failed: bool) -> None: ...

    def lost_peer(self, error: BaseException) -> None: ...  # as the process group is left (error.add_note: its line)
    def end(self) -> None: ...  # as the run ends, however it ends


PACKAGE = "engine.parts"  # the folder beside this module


def modules() -> list:
    """The part modules of this project, by name."""
    names = sorted(found.name for found in pkgutil.iter_modules([str(Path(__file__).with_name("parts"))]))
    return [importlib.import_module(f"{PACKAGE}.{name}") for name in names]


def sections() -> dict[str, type]:
    """Each part's config section class, by section name."""
    return {module.__name__.rsplit(".", 1)[-1]: module.Section for module in modules() if hasattr(module, "Section")}


def build_parts(cfg, env) -> list[Part]:
    """The parts this run's settings turn on."""
    return [part for module in modules() if (part := module.build(cfg, env)) is not None]
