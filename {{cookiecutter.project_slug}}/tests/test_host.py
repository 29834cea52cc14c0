"""The host_tuning part: glibc's allocator keeps what the steps free (FSDP's steps give
large blocks back), and the setup's objects stay out of Python's garbage collections."""

import gc
import json
import platform
import resource

import pytest
import torch

from conftest import STRATEGIES, machinery_project, reference_task, run_script
from engine.parts.host import freeze_setup_objects

MLP = reference_task().model.MLP


STEP_FAULTS = """
import json, resource, sys, torch
from engine.parts.host import SHARDED_STEPS_GIVE_BACK, set_host_allocator

torch.manual_seed(0)
layer = torch.nn.Conv2d(3, 16, 3, padding=1)
images = torch.randn(32, 3, 128, 128)  # activations of 32 MiB: above glibc's largest adaptive threshold
if sys.argv[1] == "fsdp":
    applied = set_host_allocator(SHARDED_STEPS_GIVE_BACK)
else:
    applied = set_host_allocator() if sys.argv[1] == "ddp" else None
faults = []
for step in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    layer(images).relu().square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
ACTIVATION_PAGES = 32 * 16 * 128 * 128 * 4 // resource.getpagesize()  # one activation tensor, in pages


ALLOCATOR_CASES = [
    ("ddp", {}, True, True),
    ("glibc defaults", {}, None, False),  # the control: without the setting, steps fault
    ("fsdp", {}, True, False),  # large blocks go back when freed: no fragmented heap under FSDP
    ("ddp", {"MALLOC_TRIM_THRESHOLD_": "131072"}, False, False),  # set at launch: it wins
    ("ddp", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}, False, False),
]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
@pytest.mark.parametrize(
    "mode, launch_env, applied, reused", [case for case in ALLOCATOR_CASES if case[0] != "fsdp" or "fsdp" in STRATEGIES]
)
def test_ddp_steps_reuse_freed_host_memory_fsdp_steps_give_it_back(tmp_path, mode, launch_env, applied, reused):
    script = tmp_path / "step_faults.py"
    script.write_text(STEP_FAULTS)
    result = run_script(str(script), [mode], env={"PYTHONPATH": str(machinery_project()), **launch_env})
    run = json.loads(result.stdout.splitlines()[-1])
    assert run["applied"] is applied
    # After two steps the heap has about the step's size; it may still grow now and then
    # (by a block or two, where freed blocks are too fragmented). Without the setting,
    # every step faults in each of its large blocks: about 10 activations' worth.
    steady = run["faults"][2:]
    faulted_per_step = sum(steady) / len(steady) / ACTIVATION_PAGES
    assert (faulted_per_step < 1) if reused else (faulted_per_step > 5), run["faults"]


def tracked_tensors() -> int:
    return sum(isinstance(obj, torch.Tensor) for obj in gc.get_objects())


def test_garbage_collections_after_setup_skip_setup_objects():
    model = MLP(in_features=12, hidden_dim=16, num_classes=10)
    try:
        freeze_setup_objects()
        tracked = {id(obj) for obj in gc.get_objects()}  # what a full collection walks
        assert not any(id(p) in tracked for p in model.parameters())
        before = tracked_tensors()
        made_in_the_loop = [torch.zeros(1) for _ in range(3)]
        assert tracked_tensors() == before + 3  # a leak in the loop still shows
    finally:
        gc.unfreeze()
    assert all(id(p) in {id(obj) for obj in gc.get_objects()} for p in model.parameters())
    del made_in_the_loop
