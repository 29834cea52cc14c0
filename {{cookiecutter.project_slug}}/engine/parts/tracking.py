"""Where rank 0 sends the run's figures besides metrics.jsonl: TensorBoard
(tracking.tensorboard), Weights & Biases (tracking.wandb) and MLflow (tracking.mlflow), in
any combination. Each gets the same step and epoch curves under the same names; W&B and
MLflow also get the resolved config as hyperparameters and each epoch's memory table.

A tracker run's id is kept in the checkpoint (this part's state), so a resumed or
requeued run goes on in the same tracker run; a fresh output_dir starts a new one. The
x-axis is the run's optimizer step: after a restart from an older checkpoint, the steps
trained again are logged again. A tracker that fails mid-run (its server gone, its disk
full) is dropped with a warning: metrics.jsonl has everything, and an error on rank 0
alone would leave the other ranks waiting.
"""

import importlib
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError, UsageError
from engine.logs import last_line, log
from engine.parts import Part


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
    on = cfg.tracking.tensorboard or cfg.tracking.wandb or cfg.tracking.mlflow
    return Tracking(cfg) if on else None


class Tracking(Part):
    name = "tracking"

    def __init__(self, cfg):
        self.cfg = cfg
        self.runs: dict = {}  # rank 0's run ids: a resumed run goes on in them
        self.trackers: list = []

    def state_dict(self) -> dict:
        return {"runs": self.runs}

    def load_state_dict(self, state: dict) -> None:
        self.runs = state["runs"]

    def open_log(self, start_step: int) -> None:
        self.trackers = open_trackers(self.cfg, start_step, self.runs)
        self.runs = tracker_runs(self.cfg, self.trackers)
        runs = [f"{name} run {run_id}" for name, run_id in self.runs.items() if name != "output_dir"]
        if runs:
            log(f"tracking: {', '.join(runs)}")

    def log_scalars(self, step: int, scalars: dict) -> None:
        self.each_tracker(lambda tracker: tracker.add_scalars(step, scalars))

    def log_epoch(self, row: dict) -> None:
        def send(tracker) -> None:
            tracker.add_scalars(row["step"], epoch_scalars(row))
            if "memory" in row:
                tracker.add_table("memory", row["step"], row["memory"])
            tracker.flush()

        self.each_tracker(send)

    def close_log(self, failed: bool) -> None:
        # What is still buffered reaches the disk or the server; an error marks the runs failed.
        self.each_tracker(lambda tracker: tracker.close(failed=failed))

    def each_tracker(self, call) -> None:
        """`call(tracker)` for each tracker; one that fails is dropped with a warning."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:
                self.trackers.remove(tracker)
                log(f"warning: {tracker.name} failed ({last_line(error)}); the run goes on without it")


def epoch_scalars(row: dict) -> dict:
    """Tracker tags for one epoch's row (as in metrics.jsonl): train_x as train/epoch_x,
    val_x as val/x, a part's ema_val_x (the EMA's) as val_ema/x. Memory: rank 0's figure
    and the largest over the ranks (`..._max`)."""
    scalars = {"throughput/samples_per_s": row["samples_per_s"]}
    for key, value in row.items():
        if key.endswith("_per_s") or key == "mfu":  # the task's items{{ ", model FLOPs (engine/throughput.py)" if cookiecutter.throughput }}
            scalars[f"throughput/{key}"] = value
        if key.startswith("train_") and key != "train_time_s":
            scalars[f"train/epoch_{key.removeprefix('train_')}"] = value
        elif key.startswith("val_"):
            scalars[f"val/{key.removeprefix('val_')}"] = value
        elif "_val_" in key:
            part, name = key.split("_val_", 1)
            scalars[f"val_{part}/{name}"] = value
    per_rank = row.get("memory") or [{}]
    for key in ("rss_peak_mib", "cuda_reserved_peak_mib"):
        if key in per_rank[0]:
            scalars[f"memory/{key}"] = per_rank[0][key]
            scalars[f"memory/{key}_max"] = max(r[key] for r in per_rank)
    return scalars


def open_trackers(cfg, start_step: int, previous_runs: dict) -> list:
    """The trackers the config turns on. `previous_runs`: the run ids a checkpoint kept;
    used only if that checkpoint belongs to this output_dir."""
    if previous_runs.get("output_dir") != this_output_dir(cfg):
        previous_runs = {}
    trackers = []
    try:
        if cfg.tracking.tensorboard:
            trackers += TensorBoardTracker.open(cfg, start_step)  # none, with a warning, without the package
        for kind, switch in ((WandbTracker, cfg.tracking.wandb), (MlflowTracker, cfg.tracking.mlflow)):
            if switch:
                trackers.append(start(kind, cfg, previous_runs.get(kind.name)))
    except BaseException:
        for tracker in trackers:  # those already started: not left open
            tracker.close(failed=True)
        raise
    return trackers


def start(kind: type, cfg, run_id: str | None):
    """A W&B or MLflow run; one that cannot start (no server, a bad URI) is a UsageError."""
    try:
        return kind(cfg, run_id)
    except UsageError:
        raise
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        raise UsageError(
            f"tracking.{kind.name} is on but its run cannot start ({reason}); fix its settings "
            f"or set tracking.{kind.name}=false"
        ) from None


def tracker_runs(cfg, trackers: list) -> dict:
    """What the checkpoint keeps: each tracker's run id, and whose output_dir they are."""
    runs = {tracker.name: tracker.run_id for tracker in trackers if tracker.run_id}
    return {"output_dir": this_output_dir(cfg), **runs} if runs else {}


def this_output_dir(cfg) -> str:
    return str(Path(cfg.output_dir).resolve())


def hyperparameters(cfg) -> dict:
    """The resolved config as flat `section.key: value` pairs."""
    flat = {}

    def walk(values: dict, prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(cfg.to_dict(), "")
    return flat


def import_optional(module: str, switch: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise UsageError(
            f"{switch} is on but {module} cannot be imported ({error}); install it with "
            f'pip install -e ".[{extra}]" or set {switch}=false'
        ) from None


class TensorBoardTracker:
    """Curves in output_dir/tensorboard. TensorBoard has no tables: the memory table's
    figures are curves (memory/...)."""

    name, run_id = "tensorboard", None

    def __init__(self, writer):
        self.writer = writer

    @classmethod
    def open(cls, cfg, start_step: int) -> list:
        try:
            from torch.utils.tensorboard import SummaryWriter  # here: optional, and slow to import
        except ImportError as error:
            print(
                f"warning: tracking.tensorboard is on but tensorboard cannot be imported ({error}); no TensorBoard "
                'curves. Install it with pip install -e ".[tensorboard]" or set tracking.tensorboard=false',
                flush=True,
            )
            return []
        # After a restart from an older checkpoint, TensorBoard hides the earlier run's
        # points beyond `start_step`: they were trained again.
        return [cls(SummaryWriter(str(Path(cfg.output_dir) / "tensorboard"), purge_step=start_step + 1))]

    def add_scalars(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def add_table(self, name: str, step: int, rows: list[dict]) -> None:
        pass

    def flush(self) -> None:
        self.writer.flush()  # the epoch's curves show up now, not minutes later

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run, files in output_dir/wandb. WANDB_MODE=offline records
    without a network (`wandb sync` uploads later); WANDB_ENTITY, WANDB_API_KEY etc. as
    wandb reads them."""

    name = "wandb"

    def __init__(self, cfg, run_id: str | None):
        self.wandb = import_optional("wandb", "tracking.wandb", "wandb")
        self.run = self.wandb.init(
            project=cfg.tracking.project,
            name=cfg.tracking.run_name or Path(cfg.output_dir).name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=cfg.output_dir,
            config=hyperparameters(cfg),
            settings=self.wandb.Settings(console="off"),  # leave sys.stdout alone: the run prints its own lines
        )
        self.run.define_metric("*", step_metric="step")  # the run's step, which may go back on a restart
        self.run_id = self.run.id

    def add_scalars(self, step: int, scalars: dict) -> None:
        self.run.log({**scalars, "step": step})

    def add_table(self, name: str, step: int, rows: list[dict]) -> None:
        columns = list(rows[0])
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({name: table, "step": step})

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run in the experiment tracking.project, at MLFLOW_TRACKING_URI (else
    MLflow's default, ./mlflow.db). Hyperparameters are logged when the run is created:
    MLflow keeps a parameter's first value."""

    name = "mlflow"

    def __init__(self, cfg, run_id: str | None):
        tracking = import_optional("mlflow.tracking", "tracking.mlflow", "mlflow")
        self.entities = importlib.import_module("mlflow.entities")
        self.client = tracking.MlflowClient()
        if run_id is not None and self.reopen(run_id):
            self.run_id = run_id
            return
        experiment = self.client.get_experiment_by_name(cfg.tracking.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.tracking.project)
        run = self.client.create_run(experiment_id, run_name=cfg.tracking.run_name or Path(cfg.output_dir).name)
        self.run_id = run.info.run_id
        params = [self.entities.Param(key, str(value)) for key, value in hyperparameters(cfg).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 per call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def reopen(self, run_id: str) -> bool:
        try:
            self.client.update_run(run_id, status="RUNNING")
            return True
        except importlib.import_module("mlflow.exceptions").MlflowException:
            print(
                f"note: the checkpoint's MLflow run {run_id} is not at {self.client.tracking_uri}; "
                "starting a new MLflow run",
                flush=True,
            )
            return False

    def add_scalars(self, step: int, scalars: dict) -> None:
        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def add_table(self, name: str, step: int, rows: list[dict]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"{name}/step_{step:08d}.json")

    def flush(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
