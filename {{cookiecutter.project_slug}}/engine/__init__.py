"""The machinery: distributed setup, data loading, the training and evaluation loops'
parts, checkpoints, logging and fault handling, for any task.

You should not need to open this package to train your own task: the task lives in
model.py (model, loss, metrics) and data.py (datasets, batches), the optimizer and its
schedule in recipe.py, the run's settings in config.yaml, and the order of things in
train.py. What those files use of the machinery comes from here:

    from engine import ConfigError, Mean, check_positive
"""

from engine.config import check_at_most, check_choice, check_positive, effective_batch
from engine.errors import ConfigError, TaskError, UsageError
from engine.metrics import Gathered, Mean, Sum
from engine.parts import Part
from engine.seeding import derive_seed

__all__ = [
    "ConfigError",
    "Gathered",
    "Mean",
    "Part",
    "Sum",
    "TaskError",
    "UsageError",
    "check_at_most",
    "check_choice",
    "check_positive",
    "derive_seed",
    "effective_batch",
]
