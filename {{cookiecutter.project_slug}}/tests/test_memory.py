"""Memory: CPU-mapped loads and activation checkpointing (the host allocator: test_host.py).
FSDP's memory is tested in test_fsdp.py, the per-rank report in test_memory_report.py."""

import json

import pytest
import torch

from conftest import FAST, machinery_project, read_metrics, reference_task, run_script
from engine.parallel import checkpoint_activations

reference_model = reference_task().model
BLOCKS, MLP, small_image_resnet18 = reference_model.BLOCKS, reference_model.MLP, reference_model.small_image_resnet18

RECORD_LOADS = """
import json, os, runpy, sys, torch
calls = []
real_load = torch.load

def recording_load(*args, **kwargs):
    calls.append({"map_location": str(kwargs.get("map_location")), "weights_only": kwargs.get("weights_only")})
    with open(os.path.join(os.path.dirname(__file__), "loads" + os.environ.get("RANK", "0")), "w") as f:
        json.dump(calls, f)
    return real_load(*args, **kwargs)

torch.load = recording_load
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_every_load_during_resume_is_cpu_mapped_and_weights_only(tmp_path):
    out, script = tmp_path / "run", tmp_path / "record_loads.py"
    script.write_text(RECORD_LOADS)
    run_script("train.py", [*FAST, f"output_dir={out}", "train.stop_at_step=5"], nproc=2)
    args = [*FAST, f"output_dir={out}", "train.stop_at_step=10"]
    run_script(str(script), args, nproc=2, env={"PYTHONPATH": str(machinery_project())})
    calls = [call for rank in (0, 1) for call in json.loads((tmp_path / f"loads{rank}").read_text())]
    assert len(calls) >= 2
    assert all(call == {"map_location": "cpu", "weights_only": True} for call in calls), calls


def saved_activation_bytes(model, x):
    """Bytes autograd keeps for the backward pass of one forward."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x).logsumexp(dim=1).mean()
    return loss, total


@pytest.mark.parametrize("make", [lambda: small_image_resnet18(10), lambda: MLP(3 * 16 * 16, 64, 10)])
def test_activation_checkpointing_same_gradients_less_memory(make):
    torch.manual_seed(0)
    plain, checkpointed = make(), make()
    checkpointed.load_state_dict(plain.state_dict())
    assert checkpoint_activations(checkpointed, BLOCKS) > 0
    x = torch.randn(8, 3, 16, 16)
    loss_a, bytes_a = saved_activation_bytes(plain, x)
    loss_b, bytes_b = saved_activation_bytes(checkpointed, x)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert bytes_b < 0.7 * bytes_a, (bytes_a, bytes_b)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()


def test_bf16_and_activation_checkpointing_train(tmp_path):
    out = tmp_path / "run"
    args = [*FAST, "train.precision=bf16", "train.activation_checkpointing=true", "train.epochs=1"]
    run_script("train.py", [*args, f"output_dir={out}"])
    assert read_metrics(out)[0]["val_acc"] > 0.2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_after_resume_each_process_holds_memory_on_its_own_gpu_only(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=1"], nproc=2)
    resumed = run_script("train.py", [*FAST, f"output_dir={out}", "train.epochs=2"], nproc=2)
    assert "warning: rank" not in resumed.stdout  # no rank holds more than the others
    rows = read_metrics(out)[-1]["memory"]
    assert all(row["cuda_reserved_peak_mib"] > 0 for row in rows)
    # Had rank 1 loaded the checkpoint onto GPU 0, GPU 0's peak would exceed GPU 1's.
    assert rows[0]["cuda_reserved_peak_mib"] <= 1.25 * rows[1]["cuda_reserved_peak_mib"]
