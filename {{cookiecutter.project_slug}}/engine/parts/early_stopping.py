"""End the run when checkpoint.best_metric stops improving; every rank decides alike, the count is checkpointed."""

from dataclasses import dataclass

from engine.checkpoint import checkpoint_dir
from engine.config import check_positive
from engine.hooks import Part

MOVED_KEYS = {f"train.early_stopping_{key}": f"early_stopping.{key}" for key in ("patience", "min_delta")}


@dataclass
class Section:
    patience: int = 0  # end after this many epochs without checkpoint.best_metric improving; 0 = off
    min_delta: float = 0.0  # an improvement this small or smaller does not count

    def __post_init__(self):
        check_positive("early_stopping.patience", self.patience, allow_zero=True)
        check_positive("early_stopping.min_delta", self.min_delta, allow_zero=True)


def build(cfg, env) -> "EarlyStopping | None":
    return EarlyStopping(cfg) if cfg.early_stopping.patience else None


class EarlyStopping(Part):
    name = "early_stopping"

    def __init__(self, cfg):
        self.patience, self.min_delta = cfg.early_stopping.patience, cfg.early_stopping.min_delta
        self.metric, self.sign = cfg.checkpoint.best_metric, -1 if cfg.checkpoint.best_mode == "min" else 1
        self.best_checkpoint = checkpoint_dir(cfg.output_dir) / "best.pt"
        self.best: float | None = None  # the value of the last improvement that counted
        self.epochs_without_improvement = 0

    def after_evaluation(self, state, val_metrics: dict) -> None:
        value = val_metrics[self.metric]
        if self.best is None or self.sign * (value - self.best) > self.min_delta:
            self.best, self.epochs_without_improvement = value, 0
        else:
            self.epochs_without_improvement += 1

    def stop_reason(self, state) -> str | None:
        if self.epochs_without_improvement < self.patience:
            return None
        return (
            f"early stop after epoch {state.epoch - 1}: {self.metric} has not improved by more than "
            f"{self.min_delta:g} for {self.patience} epochs; the best, {state.best_metric_value:.6g}, "
            f"is in {self.best_checkpoint}"
        )

    def state_dict(self) -> dict:
        return {"best": self.best, "epochs_without_improvement": self.epochs_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.epochs_without_improvement = state["best"], state["epochs_without_improvement"]
