"""Rank 0's figures to TensorBoard, Weights & Biases and MLflow; the runs' ids are checkpointed, so a
resume goes on in the same runs. A tracker failing mid-run is dropped: an error on rank 0 alone would hang the rest."""

import importlib
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError, UsageError
from engine.hooks import Part
from engine.logs import last_line, log

MOVED_KEYS = {"train.tensorboard": "tracking.tensorboard"}


@dataclass
class Section:
    tensorboard: bool = True  # curves in output_dir/tensorboard (rank 0; needs the tensorboard package)
    wandb: bool = False  # Weights & Biases run (rank 0; pip install -e ".[wandb]"; WANDB_MODE=offline: no network)
    mlflow: bool = False  # MLflow run at MLFLOW_TRACKING_URI, else ./mlflow.db (pip install -e ".[mlflow]")
    project: str = "{{ cookiecutter.project_slug }}"  # the W&B project and the MLflow experiment
    run_name: str = ""  # the tracker run's name; "" = output_dir's folder name

    def __post_init__(self):
        if not self.project:
            raise ConfigError("tracking.project must not be empty")


def build(cfg, env) -> "Tracking | None":
    return Tracking(cfg) if cfg.tracking.tensorboard or cfg.tracking.wandb or cfg.tracking.mlflow else None


class Tracking(Part):
    name = "tracking"

    def __init__(self, cfg):
        self.cfg, self.trackers = cfg, []
        self.runs: dict = {}  # the tracker runs' ids, and the output_dir they belong to

    def state_dict(self) -> dict:
        return {"runs": self.runs}

    def load_state_dict(self, state: dict) -> None:
        self.runs = state["runs"]

    def open_log(self, start_step: int) -> None:
        output_dir = str(Path(self.cfg.output_dir).resolve())
        previous = self.runs if self.runs.get("output_dir") == output_dir else {}  # another output_dir's: not ours
        try:
            for kind in (TensorBoardTracker, WandbTracker, MlflowTracker):
                if getattr(self.cfg.tracking, kind.name):
                    self.trackers += start(kind, self.cfg, previous.get(kind.name), start_step)
        except BaseException:
            self.close_log(failed=True)  # those already started are not left open
            raise
        runs = {tracker.name: tracker.run_id for tracker in self.trackers if tracker.run_id}
        self.runs = {"output_dir": output_dir, **runs} if runs else {}
        if runs:
            log(f"tracking: {', '.join(f'{name} run {run_id}' for name, run_id in runs.items())}")

    def log_scalars(self, step: int, scalars: dict) -> None:
        self.each_tracker(lambda tracker: tracker.add_scalars(step, scalars))

    def log_epoch(self, row: dict) -> None:
        self.each_tracker(lambda tracker: tracker.add_scalars(row["step"], epoch_scalars(row)))
        self.each_tracker(lambda tracker: tracker.end_epoch(row["step"], row.get("memory")))

    def close_log(self, failed: bool) -> None:
        self.each_tracker(lambda tracker: tracker.close(failed=failed))

    def each_tracker(self, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:
                self.trackers.remove(tracker)
                log(f"warning: {tracker.name} failed ({last_line(error)}); the run goes on without it")


def epoch_scalars(row: dict) -> dict:
    """train_x as train/epoch_x, val_x as val/x, ema_val_x as val_ema/x; memory: rank 0's and the max."""
    scalars = {}
    for key, value in row.items():
        if key.endswith("_per_s") or key == "mfu":  # samples, and the throughput part's items and model FLOPs
            scalars[f"throughput/{key}"] = value
        if key.startswith("train_") and key != "train_time_s":
            scalars[f"train/epoch_{key.removeprefix('train_')}"] = value
        elif key.startswith("val_"):
            scalars[f"val/{key.removeprefix('val_')}"] = value
        elif "_val_" in key:
            part, name = key.split("_val_", 1)
            scalars[f"val_{part}/{name}"] = value
    for key in {"rss_peak_mib", "cuda_reserved_peak_mib"} & set((row.get("memory") or [{}])[0]):
        figures = [rank[key] for rank in row["memory"]]
        scalars |= {f"memory/{key}": figures[0], f"memory/{key}_max": max(figures)}
    return scalars


def start(kind: type, cfg, run_id: str | None, start_step: int) -> list:
    switch = f"tracking.{kind.name}"
    try:
        return [kind(cfg, run_id, start_step)]
    except ImportError as error:
        why = f"{switch} is on but {kind.module} cannot be imported ({error})"
        install = f'pip install -e ".[{kind.name}]" or set {switch}=false'
        if kind is not TensorBoardTracker:
            raise UsageError(f"{why}; install it with {install}") from None
        log(f"warning: {why}; no TensorBoard curves. Install it with {install}")
        return []
    except Exception as error:
        why = f"{switch} is on but its run cannot start ({last_line(error)})"
        raise UsageError(f"{why}; fix its settings or set {switch}=false") from None


def hyperparameters(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        flat |= hyperparameters(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
    return flat


class TensorBoardTracker:
    name, module, run_id = "tensorboard", "tensorboard", None

    def __init__(self, cfg, run_id: None, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # here: optional, and slow to import

        self.writer = SummaryWriter(str(Path(cfg.output_dir) / "tensorboard"), purge_step=start_step + 1)

    def add_scalars(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def end_epoch(self, step: int, memory: list[dict] | None) -> None:
        self.writer.flush()  # the epoch's curves show up now, not minutes later

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    name = module = "wandb"

    def __init__(self, cfg, run_id: str | None, start_step: int):
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(
            project=cfg.tracking.project,
            name=cfg.tracking.run_name or Path(cfg.output_dir).name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=cfg.output_dir,
            config=hyperparameters(cfg.to_dict()),
            settings=self.wandb.Settings(console="off"),  # leave sys.stdout alone: the run prints its own lines
        )
        self.run.define_metric("*", step_metric="step")  # the run's step, which may go back on a restart
        self.run_id = self.run.id

    def add_scalars(self, step: int, scalars: dict) -> None:
        self.run.log({**scalars, "step": step})

    def end_epoch(self, step: int, memory: list[dict] | None) -> None:
        if memory:
            columns = list(memory[0])
            table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in memory])
            self.run.log({"memory": table, "step": step})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    name, module = "mlflow", "mlflow.tracking"

    def __init__(self, cfg, run_id: str | None, start_step: int):
        self.client = importlib.import_module(self.module).MlflowClient()
        self.entities = importlib.import_module("mlflow.entities")
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
                return
            except importlib.import_module("mlflow.exceptions").MlflowException:
                uri = self.client.tracking_uri
                log(f"note: the checkpoint's MLflow run {run_id} is not at {uri}; starting a new MLflow run")
        project = cfg.tracking.project
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        name = cfg.tracking.run_name or Path(cfg.output_dir).name
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        # Logged at creation only: MLflow keeps a parameter's first value.
        params = [self.entities.Param(key, str(value)) for key, value in hyperparameters(cfg.to_dict()).items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 per call
            self.client.log_batch(self.run_id, params=params[first : first + 100])

    def add_scalars(self, step: int, scalars: dict) -> None:
        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def end_epoch(self, step: int, memory: list[dict] | None) -> None:
        if memory:
            self.client.log_dict(self.run_id, {"step": step, "rows": memory}, f"memory/step_{step:08d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
