"""The machinery: distributed setup, data loading, the training and evaluation loops'
parts, checkpoints, logging and fault handling, for any task.

You should not need to open this package to train your own task: the task lives in
model.py (model, loss, metrics) and data.py (datasets, batches), the run's settings in
config.yaml, and the order of things in train.py.
"""
