"""Early stopping: end the run when checkpoint.best_metric has stopped improving.

Every rank decides alike without communicating: the validation metrics it is given are
already the same on every rank (engine.metrics reduces them exactly). The count is part
of the checkpoint, so a resumed or requeued run keeps it.
"""

from dataclasses import dataclass


@dataclass
class EarlyStopping:
    patience: int  # epochs without improvement before stopping; 0 = never stop early
    min_delta: float  # an improvement of this much or less does not count
    metric: str  # checkpoint.best_metric
    mode: str  # checkpoint.best_mode: min | max
    best: float | None = None  # the value of the last improvement that counted
    epochs_without_improvement: int = 0

    @classmethod
    def from_config(cls, cfg) -> "EarlyStopping":
        train, checkpoint = cfg.train, cfg.checkpoint
        return cls(
            train.early_stopping_patience, train.early_stopping_min_delta, checkpoint.best_metric, checkpoint.best_mode
        )

    @classmethod
    def off(cls) -> "EarlyStopping":
        return cls(patience=0, min_delta=0.0, metric="", mode="min")

    def update(self, val_metrics: dict) -> None:
        """Count the epoch just evaluated (before its checkpoint, which then holds it)."""
        if not self.patience:
            return
        value = val_metrics[self.metric]
        gain = (self.best - value if self.mode == "min" else value - self.best) if self.best is not None else None
        if gain is None or gain > self.min_delta:
            self.best, self.epochs_without_improvement = value, 0
        else:
            self.epochs_without_improvement += 1

    @property
    def stopped(self) -> bool:
        return bool(self.patience) and self.epochs_without_improvement >= self.patience

    def summary(self, epoch: int, best_value: float, best_checkpoint: str) -> str:
        return (
            f"early stop after epoch {epoch}: {self.metric} has not improved by more than {self.min_delta:g} "
            f"for {self.patience} epochs; the best, {best_value:.6g}, is in {best_checkpoint}"
        )

    def state_dict(self) -> dict:
        return {"best": self.best, "epochs_without_improvement": self.epochs_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.epochs_without_improvement = state["best"], state["epochs_without_improvement"]
