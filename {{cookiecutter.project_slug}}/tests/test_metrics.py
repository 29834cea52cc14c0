"""Validation metrics: fixed batches dealt whole to ranks, per-batch sums added in batch
order, gathered rows in dataset order: the same bits on any number of processes (real
torchrun processes with uneven shares, one rank with no batch); and a metric updated
with the wrong number of rows is one line naming it."""

import json

import pytest
import torch

from conftest import machinery_project, run_script
from engine.distributed import DistEnv
from engine.errors import TaskError
from engine.loader import EvalBatches
from engine.metrics import Gathered, Mean, Sum, check_metrics, compute_metrics

CPU = torch.device("cpu")


def test_batches_are_fixed_in_dataset_order_and_dealt_whole():
    # 11 samples in batches of 3: [0-2] [3-5] [6-8] [9-10], dealt to 3 ranks.
    shares = [list(EvalBatches(11, 3, DistEnv(rank=r, world_size=3))) for r in range(3)]
    assert shares == [[[0, 1, 2], [9, 10]], [[3, 4, 5]], [[6, 7, 8]]]
    assert list(EvalBatches(11, 3, DistEnv())) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert list(EvalBatches(2, 3, DistEnv(rank=1, world_size=2))) == []  # no batch for rank 1


def one_process_results(metrics: dict, batches: list[list], plan: EvalBatches) -> dict:
    check_metrics(metrics)
    for batch_id, update in enumerate(batches):
        update(metrics)
        for metric in metrics.values():
            metric.end_batch(plan.samples_in(batch_id))
    return compute_metrics(metrics, plan, plan.num_batches, CPU)


def test_every_kind_of_update_on_one_process():
    plan = EvalBatches(3, 2, DistEnv())  # batches of 2 and 1 samples
    mean, tokens = Mean(), Mean()
    confusion = Sum(shape=(2, 2), compute=lambda total: {"hits": total.trace(), "all": total.sum()})
    median = Gathered(compute=lambda values, names: {"median": values.median(), "first": float(names[0] == "a")})

    def first(m):
        m["acc"].update(torch.tensor([1.0, 0.0]))
        m["tokens"].update(torch.tensor(6.0), count=3)  # a sum over 3 tokens
        m["cm"].update(torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]]))  # a row per sample
        m["g"].update(torch.tensor([5.0, 1.0]), ["a", "b"])

    def second(m):
        m["acc"].update(torch.tensor([1.0]))
        m["tokens"].update(torch.tensor(2.0), count=torch.tensor(5))
        m["cm"].update(torch.tensor([[0.0, 0.0], [0.0, 3.0]]), count=1)  # the batch's total
        m["g"].update(torch.tensor([3.0]), ["c"])

    metrics = {"acc": mean, "tokens": tokens, "cm": confusion, "g": median}
    assert one_process_results(metrics, [first, second], plan) == {
        "val_acc": 2 / 3,
        "val_tokens": 8 / 8,
        "val_hits": 4.0,
        "val_all": 5.0,
        "val_median": 3.0,
        "val_first": 1.0,
        "num_samples": 3,
    }


@pytest.mark.parametrize(
    "metric, update, message",
    [
        (Mean(), lambda m: m.update(torch.tensor(0.5)), r"metric 'x': Mean.update got shape \[\]; give one row per"),
        (Mean(), lambda m: m.update(torch.ones(4, 2)), r"Mean.update got shape \[4, 2\]; .* \(shape \[batch\]\)"),
        (Mean(), lambda m: m.update(torch.ones(3)), r"metric 'x': Mean.update got 3 rows for a batch of 4 samples"),
        (Mean(), lambda m: m.update(0.5), r"metric 'x': Mean.update needs a tensor, got float"),
        (Sum((2,)), lambda m: m.update(torch.ones(2)), r"Sum.update got shape \[2\]; .* \(shape \[batch, 2\]\)"),
        (
            Sum((2,)),
            lambda m: m.update(torch.ones(3), count=4),
            r"count=n\) got shape \[3\], not the Sum's shape \[2\]",
        ),
        (Gathered(compute=len), lambda m: m.update(torch.ones(1)), r"Gathered.update got 1 rows for a batch of 4"),
        (Gathered(compute=len), lambda m: m.update(torch.ones(4), torch.tensor(1.0)), r"column 2 is a single value"),
    ],
)
def test_a_wrong_update_names_the_metric_and_the_fix(metric, update, message):
    check_metrics({"x": metric})
    with pytest.raises(TaskError, match=message):
        update(metric)
        metric.end_batch(4)


def test_counts_other_than_the_batch_are_fine_with_count():
    metric = check_metrics({"loss": Mean()})["loss"]
    metric.update(torch.ones(7, 3).sum(), count=21)  # per-token: 21 tokens in 4 samples
    metric.end_batch(4)
    assert compute_metrics({"loss": metric}, EvalBatches(4, 4, DistEnv()), 1, CPU)["val_loss"] == 1.0


def test_metrics_must_be_of_a_known_kind():
    with pytest.raises(TaskError, match=r"metric 'auc' is a dict; build_metrics must return engine.metrics"):
        check_metrics({"auc": {}})


SHARDED = """
import json, sys, torch
from engine.config import DistConfig
from engine.distributed import cleanup_distributed, init_distributed_mode
from engine.loader import EvalBatches
from engine.metrics import Gathered, Mean, check_metrics, compute_metrics

size = int(sys.argv[1])
env, device = init_distributed_mode(DistConfig())
plan = EvalBatches(size, 2, env)  # batches of 2
mean = Mean()
order = Gathered(compute=lambda index, label: {"order": float(index.tolist() == list(range(size))),
                                               "labels": float(label == [f"s{i}" for i in range(size)])})
metrics = check_metrics({"mean_index": mean, "order": order})
values = 1 / torch.arange(1, size + 1, dtype=torch.float64)  # summed rank by rank: other last bits
for batch_id, indices in zip(plan.batch_ids, plan):
    batch = torch.tensor(indices)
    mean.update(values[batch])
    order.update(batch, [f"s{i}" for i in indices])
    for metric in metrics.values():
        metric.end_batch(len(indices))
results = compute_metrics(metrics, plan, plan.num_batches, device)
with open(f"{sys.argv[2]}/rank{env.rank}-of-{env.world_size}.json", "w") as f:  # not stdout: lines would interleave
    json.dump(results, f)
cleanup_distributed()
"""


@pytest.mark.parametrize("size", [101, 2])  # 101: 51 batches, shares 17/17/17 and 26/25; 2: rank 1 and 2 have none
def test_one_two_and_three_processes_give_the_same_bits(tmp_path, size):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    env = {"PYTHONPATH": str(machinery_project())}
    for nproc in (None, 2, 3):
        run_script(str(script), [size, tmp_path], nproc=nproc, env=env)
    files = ["rank0-of-1", "rank0-of-2", "rank1-of-2", "rank0-of-3", "rank1-of-3", "rank2-of-3"]
    results = [json.loads((tmp_path / f"{name}.json").read_text()) for name in files]
    assert results[0]["num_samples"] == size and results[0]["val_order"] == results[0]["val_labels"] == 1.0
    assert results == [results[0]] * len(files)  # equal with ==: every rank, every world size
