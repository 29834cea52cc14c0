"""Same math on any number of processes: exact training, exact evaluation, exact resume.

Each test launches real processes (python or torchrun on CPU with gloo).
"""

import json
import shutil

import pytest
import torch

from conftest import FAST, read_metrics, reference_config, reference_task, run_script, tensors
from engine.checkpoint import load_checkpoint


def final_state(output_dir):
    return load_checkpoint(output_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize(
    "nproc, batch_size, accum, strategy",
    [(2, 8, 1, "ddp"), (1, 8, 2, "ddp"), (2, 4, 2, "ddp"), (2, 8, 1, "fsdp"), (4, 2, 2, "fsdp")],
)
def test_world_size_and_accumulation_do_not_change_training(tmp_path, nproc, batch_size, accum, strategy):
    """N processes x batch B x accumulation K trains like 1 process with batch N*B*K,
    with DDP and with FSDP (whose ranks start from rank 0's weights, built once)."""
    common = [
        *FAST,
        "data.augment=true",
        "train.epochs=1",
        "checkpoint.resume=none",
        f"fsdp.enabled={strategy == 'fsdp'}",
    ]
    reference, other = tmp_path / "reference", tmp_path / "other"
    run_script("train.py", [*common, "train.batch_size=16", f"output_dir={reference}"])
    run_script(
        "train.py",
        [*common, f"train.batch_size={batch_size}", f"train.accum_steps={accum}", f"output_dir={other}"],
        nproc=nproc if nproc > 1 else None,
    )
    a, b = final_state(reference), final_state(other)
    assert a["step"] == b["step"] == 1024 // 16
    for key, weight in a["model"].items():
        torch.testing.assert_close(b["model"][key], weight, rtol=1e-4, atol=1e-5, msg=key)


def test_evaluation_counts_every_sample_once_on_any_world_size(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, "train.epochs=1", f"output_dir={out}"])
    checkpoint = out / "checkpoints" / "last.pt"
    results = []
    for nproc in (None, 2, 3):
        # 101 samples (prime) in batches of 11 (10 batches): ranks get 4/3/3 of them.
        args = ["--checkpoint", checkpoint, "train.eval_batch_size=11"]
        shown = run_script("evaluate.py", args, nproc=nproc).stdout.strip().splitlines()
        results.append(json.loads(shown[-1]))
    assert [r["num_samples"] for r in results] == [101, 101, 101]
    assert results == [results[0]] * 3  # to the last bit: the same batches on any world size


RESUME = [
    *FAST,
    "data.augment=true",
    "model.dropout=0.2",  # in-model randomness: resume must restore every rank's RNG
    "train.epochs=2",
]


@pytest.mark.parametrize(
    "nproc, workers, stop_at, strategy", [(None, 0, 37, "ddp"), (2, 2, 21, "ddp"), (2, 0, 21, "fsdp")]
)
def test_interrupted_run_resumes_bitwise_identical(tmp_path, nproc, workers, stop_at, strategy):
    """Under FSDP the checkpoints are sharded folders (each rank writes its own shards)."""
    args = [*RESUME, f"train.num_workers={workers}", f"fsdp.enabled={strategy == 'fsdp'}"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_script("train.py", [*args, f"output_dir={whole}"], nproc=nproc)
    stopped = run_script("train.py", [*args, f"output_dir={split}", f"train.stop_at_step={stop_at}"], nproc=nproc)
    assert f"stopped at step {stop_at}" in stopped.stdout
    assert final_state(split)["step"] == stop_at
    assert (split / "checkpoints" / "last.pt").is_dir() == (strategy == "fsdp")
    resumed = run_script("train.py", [*args, f"output_dir={split}"], nproc=nproc)
    assert "resumed from" in resumed.stdout

    a, b = final_state(whole), final_state(split)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    assert tensors(a["model"]).keys() == tensors(b["model"]).keys()
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert a["scheduler"] == b["scheduler"]
    assert [m["val_loss"] for m in read_metrics(whole)] == [m["val_loss"] for m in read_metrics(split)]


def test_the_sanity_check_before_training_changes_nothing(tmp_path):
    """It evaluates 2 batches per rank before the first step: with dropout and random
    augmentation on 2 processes, the run ends bitwise as one without it. (Where
    validation_step draws random numbers, the check gives the RNG back: the regression
    task of test_task_interface.py draws some and resumes bitwise mid-epoch.)"""
    args = [*RESUME, "train.epochs=1"]
    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    run_script("train.py", [*args, f"output_dir={checked}"], nproc=2)
    run_script("train.py", [*args, "train.sanity_check=false", f"output_dir={unchecked}"], nproc=2)
    a, b = final_state(checked), final_state(unchecked)
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs"
    assert a["rng"] == b["rng"]
    assert [m["val_loss"] for m in read_metrics(checked)] == [m["val_loss"] for m in read_metrics(unchecked)]


def test_resume_on_another_world_size_continues_and_says_so(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*RESUME, f"output_dir={out}", "train.stop_at_step=10"], nproc=2)
    resumed = run_script("train.py", [*RESUME, f"output_dir={out}"])
    assert resumed.stdout.count("the data order from here differs") == 1
    state = final_state(out)
    assert state["epoch"] == 2 and state["step"] == 10 + 1024 // 16 - 10 * 2 + 1024 // 16


# Resumes from a checkpoint the way train.py does, then saves what it loaded (rank 0).
LOAD_AND_DUMP = """
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import train
from engine.checkpoint import Checkpointer
from engine.distributed import cleanup_distributed, init_distributed_mode, is_main

cfg = train.load_config(None, sys.argv[2:], data=train.DataConfig, model=train.ModelConfig, optim=train.OptimConfig)
env, device = init_distributed_mode(cfg.dist)
checkpointer = Checkpointer(cfg, env, device)
state = train.load_train_objs(cfg, env, device, checkpointer, train.build_parts(cfg, env))[2]
checkpointer.resume(state)
loaded = state.state_dict()
if is_main():
    torch.save(loaded, sys.argv[1])
cleanup_distributed()
"""


SHARDED = [*RESUME, "optim.name=adamw", "train.epochs=1"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """FSDP on 2 processes stopped at step 10, mid-epoch: its checkpoints are sharded
    folders. Tests that train on from it work in a copy."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    run_script("train.py", [*SHARDED, "fsdp.enabled=true", f"output_dir={out}", "train.stop_at_step=10"], nproc=2)
    assert (out / "checkpoints" / "last.pt").is_dir()
    return out


def load_and_dump(tmp_path, args, nproc) -> dict:
    """What train.py's setup and resume leave in the model and optimizer, as rank 0 sees it."""
    script, dump = tmp_path / "load_and_dump.py", tmp_path / "loaded.pt"
    script.write_text(LOAD_AND_DUMP)
    run_script(str(script), [dump, *args], nproc=nproc)
    return torch.load(dump, weights_only=True)


def assert_same_tensors(expected: dict, got: dict, what: str) -> None:
    expected, got = tensors(expected), tensors(got)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{what}{key} differs after loading"


@pytest.mark.parametrize("nproc, strategy", [(3, "fsdp"), (2, "ddp"), (None, "ddp")])
def test_a_sharded_checkpoint_loads_exactly_on_other_layouts(tmp_path, sharded_run, nproc, strategy):
    """FSDP on 3 processes (resharded), DDP on 2 and one process load the 2-process FSDP
    checkpoint's model and optimizer to the bit, and training continues."""
    out = tmp_path / "run"
    shutil.copytree(sharded_run, out, symlinks=True)
    saved_path = out / "checkpoints" / "last.pt"
    saved = load_checkpoint(saved_path)
    layout = [
        f"fsdp.enabled={strategy == 'fsdp'}",
        f"output_dir={tmp_path / 'other'}",
        f"checkpoint.resume={saved_path}",
    ]
    loaded = load_and_dump(tmp_path, [*SHARDED, *layout], nproc)
    for part in ("model", "optimizer"):
        assert_same_tensors(saved[part], loaded[part], part)
    assert loaded["scheduler"] == saved["scheduler"] and loaded["step"] == 10
    resumed = run_script("train.py", [*SHARDED, f"fsdp.enabled={strategy == 'fsdp'}", f"output_dir={out}"], nproc=nproc)
    assert "resumed from" in resumed.stdout and final_state(out)["epoch"] == 1


def test_evaluate_init_from_and_export_read_a_sharded_checkpoint(tmp_path, sharded_run):
    """evaluate.py gives the same bits on 1, 2 and 3 processes (FSDP-sharded on 2 and 3,
    as the checkpoint's config says); fine-tuning starts from its weights only; export.py
    writes them as one plain file that loads into the model, and never overwrites a file."""
    checkpoint = sharded_run / "checkpoints" / "last.pt"
    results = []
    for nproc in (None, 2, 3):
        args = ["--checkpoint", checkpoint, "train.eval_batch_size=11"]
        results.append(json.loads(run_script("evaluate.py", args, nproc=nproc).stdout.strip().splitlines()[-1]))
    assert results[0]["num_samples"] == 101 and results[0]["step"] == 10
    assert results == [results[0]] * 3

    fine_tune = [f"output_dir={tmp_path / 'fine_tune'}", f"checkpoint.init_from={checkpoint}"]
    loaded = load_and_dump(tmp_path, [*SHARDED, *fine_tune], None)
    assert_same_tensors(load_checkpoint(checkpoint)["model"], loaded["model"], "model")
    assert (loaded["epoch"], loaded["step"]) == (0, 0)  # weights only: the run starts at its beginning

    exported = tmp_path / "weights" / "model.pt"
    shown = run_script("export.py", ["--checkpoint", checkpoint, "--out", exported]).stdout
    assert shown.startswith(f"wrote {exported}: ")
    model = reference_task().model.build_model(reference_config(None, SHARDED))
    model.load_state_dict(torch.load(exported, weights_only=True))  # strict: every name and shape
    assert_same_tensors(load_checkpoint(checkpoint)["model"], model.state_dict(), "model")
    again = run_script("export.py", ["--checkpoint", checkpoint, "--out", exported], check=False)
    assert (
        again.returncode == 2
        and again.stderr == f"error: {str(exported)!r} already exists; choose another --out or remove it first\n"
    )


def test_deterministic_switch():
    from engine.seeding import set_determinism

    try:
        set_determinism(True, torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        set_determinism(False, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
