"""Early stopping: end the run when checkpoint.best_metric has stopped improving.

Every rank decides alike without communicating: the validation metrics it is given are
already the same on every rank (engine.metrics reduces them exactly). The count is part
of the checkpoint, so a resumed or requeued run keeps it.
"""

from dataclasses import dataclass

from engine.checkpoint import checkpoint_dir
from engine.config import check_positive
from engine.parts import Part


@dataclass
class Section:
    patience: int = 0  # end after this many epochs without checkpoint.best_metric improving; 0 = off
    min_delta: float = 0.0  # an improvement this small or smaller does not count

    def __post_init__(self):
        check_positive("early_stopping.patience", self.patience, allow_zero=True)
        check_positive("early_stopping.min_delta", self.min_delta, allow_zero=True)


def build(cfg, env) -> "EarlyStopping | None":
    if not cfg.early_stopping.patience:
        return None
    best = checkpoint_dir(cfg.output_dir) / "best.pt"
    return EarlyStopping(cfg.early_stopping, cfg.checkpoint.best_metric, cfg.checkpoint.best_mode, str(best))


class EarlyStopping(Part):
    name = "early_stopping"

    def __init__(self, section: Section, metric: str, mode: str, best_checkpoint: str):
        self.patience, self.min_delta = section.patience, section.min_delta
        self.metric, self.mode, self.best_checkpoint = metric, mode, best_checkpoint  # checkpoint.best_*
        self.best: float | None = None  # the value of the last improvement that counted
        self.epochs_without_improvement = 0

    def after_evaluation(self, state, val_metrics: dict) -> None:
        """Count the epoch just evaluated (before its checkpoint, which then holds it)."""
        value = val_metrics[self.metric]
        gain = (self.best - value if self.mode == "min" else value - self.best) if self.best is not None else None
        if gain is None or gain > self.min_delta:
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
