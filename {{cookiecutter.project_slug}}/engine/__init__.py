"""The machinery for any task: distributed setup, data loading, the loops' parts,
checkpoints, logging and fault handling. A task needs not open it: it lives in model.py
(model, loss, metrics), data.py (datasets, batches), recipe.py (optimizer, schedule),
config.yaml (settings) and train.py (the order of things), which import from here."""

from engine.config import check_at_most, check_choice, check_positive, effective_batch
from engine.errors import ConfigError, TaskError, UsageError
from engine.hooks import Part
from engine.metrics import Gathered, Mean, Sum
from engine.seeding import derive_seed

# What a task imports from here: errors, metrics and the Part protocol; then helpers.
__all__ = ["ConfigError", "Gathered", "Mean", "Part", "Sum", "TaskError", "UsageError"]
__all__ += ["check_at_most", "check_choice", "check_positive", "derive_seed", "effective_batch"]
