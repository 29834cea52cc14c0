"""Speed in the task's units and the model FLOPs utilisation: the FLOPs counted for a
micro-batch are the model's own, the figures in a real run agree with each other, and
the peak is known only where it should be."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import FAST, read_metrics, reference_config, reference_task, run_script
from engine.errors import TaskError
from engine.parts.throughput import Throughput, peak_flops


@pytest.mark.parametrize(
    ("configured", "name", "precision", "expected"),
    [
        (0.0, None, "bf16", None),  # CPU: no data sheet
        (0.0, "NVIDIA A100-SXM4-80GB", "fp32", None),  # the table is for bf16/fp16 tensor cores
        (0.0, "NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        (0.0, "NVIDIA H100 PCIe", "fp16", 756e12),
        (0.0, "NVIDIA H100 80GB HBM3", "bf16", 989e12),
        (0.0, "NVIDIA L40S", "bf16", 362e12),
        (0.0, "NVIDIA L4", "bf16", 121e12),
        (0.0, "NVIDIA A10", "bf16", 125e12),
        (0.0, "Tesla V100-SXM2-32GB", "fp16", 125e12),
        (0.0, "Tesla V100-SXM2-32GB", "bf16", None),  # V100 has no bf16
        (0.0, "Some Future GPU", "bf16", None),
        (0.0, "NVIDIA L40", "bf16", None),  # not an L4
        (0.0, "NVIDIA RTX A1000", "bf16", None),  # not an A100
        (2.5, None, "fp32", 2.5e12),  # throughput.peak_tflops wins everywhere
        (2.5, "NVIDIA A100-SXM4-80GB", "bf16", 2.5e12),
    ],
)
def test_the_peak_is_the_setting_or_a_listed_gpus_bf16_fp16_figure(configured, name, precision, expected):
    assert peak_flops(configured, name, precision) == expected


@pytest.mark.parametrize(("batch", "hidden"), [(4, 8), (16, 32)])
def test_the_flops_counted_are_the_models_forward_and_backward(batch, hidden):
    """The reference MLP (in -> hidden -> hidden -> classes): 2 FLOPs per multiply-add, the
    forward once, the backward's weight gradients as many, and its input gradients for
    every layer but the first (the images need none)."""
    task = reference_task()
    cfg = reference_config(None, [*FAST, f"model.hidden_dim={hidden}"])
    model = task.model.build_model(cfg)
    images, labels = torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))
    throughput = Throughput(peak=1e12)
    with throughput.counting_flops():
        F.cross_entropy(model(images), labels).backward()
    layers = [3 * 8 * 8 * hidden, hidden * hidden, hidden * 10]
    assert throughput.flops_per_micro_batch == 2 * batch * (2 * sum(layers) + sum(layers[1:]))
    with throughput.counting_flops():  # counted once: the next micro-batch runs as it would without it
        model(images)
    assert throughput.flops_per_micro_batch == 2 * batch * (2 * sum(layers) + sum(layers[1:]))


@pytest.mark.parametrize("returned", [64, ("pixels",), [("pixels", 64)], ("pixels", [64, 64]), ("pixels", "many")])
def test_count_items_returning_anything_but_a_unit_and_one_number_is_one_line(returned):
    throughput = Throughput(count_items=lambda batch: returned)
    with pytest.raises(TaskError, match=r"count_items returned .*; return \(unit, count\) with one number"):
        throughput.add(batch=None)


@pytest.mark.parametrize(("nproc", "accum_steps"), [(None, 1), (2, 2)])
def test_a_run_reports_items_model_flops_and_mfu_that_agree(tmp_path, nproc, accum_steps):
    args = [*FAST, "data.train_size=256", "train.epochs=1", f"train.accum_steps={accum_steps}"]
    result = run_script("train.py", [*args, "throughput.peak_tflops=0.5", f"output_dir={tmp_path}"], nproc=nproc)
    (row,) = read_metrics(tmp_path)
    assert row["pixels_per_s"] == pytest.approx(row["samples_per_s"] * 8 * 8, rel=1e-9)  # count_items: 8x8 images
    assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] / 0.5, rel=1e-9) and 0 < row["mfu"] < 1
    # This process's micro-batches (256 samples / 16 per micro-batch / processes) x the MLP's FLOPs each.
    layers = [3 * 8 * 8 * 32, 32 * 32, 32 * 10]
    flops = 2 * 16 * (2 * sum(layers) + sum(layers[1:])) * 256 // (16 * (nproc or 1))
    assert row["model_tflops_per_s"] == pytest.approx(flops / row["train_time_s"] / 1e12, rel=1e-9)
    assert f"MFU {row['mfu']:.1%}" in result.stdout and f"{row['pixels_per_s']:,.0f} pixels/s" in result.stdout

    plain = tmp_path / "plain"  # no peak known (CPU): nothing counted, the same training
    run_script("train.py", [*args, f"output_dir={plain}"], nproc=nproc)
    (unmeasured,) = read_metrics(plain)
    assert "mfu" not in unmeasured and "model_tflops_per_s" not in unmeasured
    assert json.dumps(unmeasured["train_loss"]) == json.dumps(row["train_loss"])
    assert unmeasured["val_acc"] == row["val_acc"]
