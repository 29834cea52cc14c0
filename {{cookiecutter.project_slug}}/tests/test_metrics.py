"""Validation metrics: sums reduced once, gathered metrics in dataset order, on any number
of processes (real torchrun processes with shards of different lengths, one empty)."""

import json

import numpy as np
import pytest
import torch

from conftest import machinery_project, run_script
from engine.config import UsageError
from engine.metrics import Gathered, Mean, Sum, compute_metrics, interleave

CPU = torch.device("cpu")


def test_mean_sum_and_gathered_on_one_process():
    mean, confusion = Mean(), Sum(shape=(2, 2), compute=lambda total: {"hits": total.trace(), "all": total.sum()})
    gathered = Gathered(compute=lambda values, names: {"median": values.median(), "first": float(names[0] == "a")})
    mean.update(torch.tensor([1.0, 0.0, 1.0]))
    mean.update(torch.tensor(6.0), count=3)  # a sum over 3 items
    confusion.update(torch.tensor([[2.0, 1.0], [0.0, 3.0]]))
    gathered.update(torch.tensor([5.0, 1.0]), ["a", "b"])
    gathered.update(torch.tensor([3.0]), ["c"])
    results = compute_metrics({"acc": mean, "cm": confusion, "g": gathered}, num_samples=3, device=CPU)
    assert results == {
        "val_acc": 8 / 6,
        "val_hits": 5.0,
        "val_all": 6.0,
        "val_median": 3.0,
        "val_first": 1.0,
        "num_samples": 3,
    }


def test_rows_come_back_in_dataset_order():
    # 3 ranks, 7 samples: rank r held samples r, r + 3, ...
    shards = [np.array([0, 3, 6]), np.array([1, 4]), np.array([2, 5])]
    assert interleave(shards, 3).tolist() == list(range(7))
    assert interleave([["a", "c"], ["b"]], 2) == ["a", "b", "c"]


def test_a_gathered_metric_needs_one_row_per_sample():
    metric = Gathered(compute=lambda values: values.sum())
    metric.update(torch.tensor([1.0]))  # one row for a batch of two samples
    with pytest.raises(UsageError, match=r"metric 'bad': rank 0 gave 1 rows for 2 samples"):
        compute_metrics({"bad": metric}, num_samples=2, device=CPU)


def test_metrics_must_be_of_a_known_kind():
    with pytest.raises(UsageError, match=r"metric 'auc' is a dict; build_metrics must return engine.metrics"):
        compute_metrics({"auc": {}}, num_samples=0, device=CPU)


SHARDED = """
import json, sys, torch
from engine.config import DistConfig
from engine.distributed import DistEnv, cleanup_distributed, init_distributed_mode
from engine.loader import ShardSampler
from engine.metrics import Gathered, Mean, compute_metrics

size = int(sys.argv[1])
env, device = init_distributed_mode(DistConfig())
mine = list(ShardSampler(size, env))  # the samples this rank evaluates
mean = Mean()
order = Gathered(compute=lambda index, label: {"order": float(index.tolist() == list(range(size))),
                                               "labels": float(label == [f"s{i}" for i in range(size)])})
for start in range(0, len(mine), 2):  # batches of 2
    batch = torch.tensor(mine[start:start + 2], dtype=torch.float32)
    mean.update(batch)
    order.update(batch.long(), [f"s{i}" for i in batch.long().tolist()])
results = compute_metrics({"mean_index": mean, "order": order}, len(mine), device)
with open(f"{sys.argv[2]}/rank{env.rank}.json", "w") as f:  # not stdout: the ranks' lines would interleave
    json.dump(results, f)
cleanup_distributed()
"""


@pytest.mark.parametrize("size", [7, 2])  # 7: shards of 3/2/2; 2: rank 2 has no sample
def test_three_processes_agree_on_exact_metrics(tmp_path, size):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    run_script(str(script), [size, tmp_path], nproc=3, env={"PYTHONPATH": str(machinery_project())})
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    expected = {"val_mean_index": (size - 1) / 2, "val_order": 1.0, "val_labels": 1.0, "num_samples": size}
    assert results == [expected] * 3  # every rank gets the same figures
