"""FSDP (the fsdp part): its sharded checkpoints (step-*.dcp folders) saved, loaded whole,
refused when torn or hostile, and read on other layouts and by every entry point; a run
killed mid-save; DDP and FSDP resuming each other; and what each rank holds in memory.

A project generated without FSDP has no such tests: this file goes with engine/parts/fsdp.py.
Tests that run under DDP and FSDP alike stay in their files (conftest.STRATEGIES).
"""

import json
import os
import pickle
import platform
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    FAST,
    PROJECT,
    children,
    clean_env,
    command,
    has,
    machinery_project,
    read_metrics,
    reference_config,
    reference_task,
    run_script,
    tensors,
    wait_for_line,
)
from engine.checkpoint import Checkpointer, CheckpointError, load_checkpoint, load_resume_checkpoint, step_checkpoints
from engine.distributed import DistEnv
from engine.errors import TaskError
from engine.parts import fsdp
from engine.parts.fsdp import build_on_meta
from engine.sharded import load_full, load_sharded, save_sharded, sharded_state_dict
from test_checkpoint import RunsCode, RunsSystem, make_state, one_error_line, run_dir_config
from test_exactness import RESUME, final_state
from test_faults import last

# -- sharded checkpoints: loaded whole, hostile or torn ones refused ---------------------------


def sharded_checkpoint(tmp_path, extra=None):
    """A sharded (DCP) checkpoint of one process, with `extra` items beside model and optimizer."""
    state, _ = make_state()
    folder = tmp_path / "step-00000001.dcp"
    save_sharded({**sharded_state_dict(state.model, state.optimizer), **(extra or {})}, folder, folder)
    return state, folder


def test_a_sharded_checkpoint_loads_whole(tmp_path):
    state, folder = sharded_checkpoint(tmp_path)
    loaded = load_full(folder)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state.model.state_dict().items())
    saved_exp_avg = state.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(loaded["optimizer"]["state"]["net.2.linear.weight"]["exp_avg"], saved_exp_avg)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == state.optimizer.param_groups[0]["lr"]


def test_sharded_metadata_that_runs_code_is_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "pwned"
    _, folder = sharded_checkpoint(tmp_path)
    metadata = FileSystemReader(folder).read_metadata()  # our own file: safe to unpickle
    metadata.storage_meta.modules = [RunsCode(marker)]
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*/\.metadata' holds code \(io\.open\); refused$"):
        load_full(folder)
    with pytest.raises(CheckpointError, match="holds code"):
        load_checkpoint(folder)
    assert not marker.exists()
    FileSystemReader(folder).read_metadata()  # DCP's own reader runs it: the test can fail
    assert marker.exists()


@pytest.mark.parametrize("relative_path", ["../../etc/passwd", "/dev/zero", ".hidden"])
def test_sharded_metadata_pointing_outside_its_folder_is_refused(tmp_path, relative_path):
    from torch.distributed.checkpoint import FileSystemReader

    _, folder = sharded_checkpoint(tmp_path)
    metadata = FileSystemReader(folder).read_metadata()  # our own file: safe to unpickle
    next(iter(metadata.storage_data.values())).relative_path = relative_path
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"points outside its folder .*; refused$"):
        load_full(folder)


ITEM_REFUSED = r"^checkpoint '.*' holds code or unreadable data in '{}'; refused \(io\.open\)$"


def test_sharded_item_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    _, folder = sharded_checkpoint(tmp_path, extra={"payload": RunsCode(marker)})  # a pickled non-tensor item
    with pytest.raises(CheckpointError, match=ITEM_REFUSED.format("payload")):
        load_full(folder)
    assert not marker.exists()


def test_model_weights_alone_never_read_the_optimizer_state(tmp_path):
    """evaluate.py and init_from load a sharded checkpoint's model only: a hostile item in
    its optimizer state is not even read then, and refused when the optimizer is loaded."""
    marker = tmp_path / "pwned"
    state, folder = sharded_checkpoint(tmp_path)
    saved = sharded_state_dict(state.model, state.optimizer)
    saved["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)  # an item the optimizer reads
    save_sharded(saved, folder, folder)
    fresh, _ = make_state(seed=1)
    load_sharded(fresh.model, folder)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in state.model.state_dict().items())
    with pytest.raises(CheckpointError, match=ITEM_REFUSED.format(r"optimizer\.param_groups\.0\.lr")):
        load_sharded(fresh.model, folder, fresh.optimizer)
    assert not marker.exists()


def test_a_folder_saved_again_at_its_step_never_replaces_the_published_one(tmp_path, capsys):
    """An epoch's end often falls on a step checkpoint's step. The second folder gets the
    next free name, so best.pt keeps the weights that were best; a last.pt whose folder is
    gone is said and the next checkpoint taken, not silently skipped."""
    state, _ = make_state()
    cfg = reference_config(None, ["fsdp.enabled=true", "checkpoint.best_metric=val_loss", f"output_dir={tmp_path}"])
    state.register("fsdp", fsdp.build(cfg, DistEnv()))  # its checkpoints are folders
    checkpointer, directory = Checkpointer(cfg, DistEnv(), torch.device("cpu")), tmp_path / "checkpoints"
    state.step = 40
    checkpointer.save(state, {"val_loss": 1.0})  # best
    best_weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    torch.nn.init.zeros_(state.model.net[2].linear.weight)  # other weights, at the same step
    state.epoch = 1
    checkpointer.save(state, {"val_loss": 2.0})  # not best
    assert [p.name for p in step_checkpoints(directory)] == ["step-00000040.dcp", "step-00000040.1.dcp"]
    assert (
        os.readlink(directory / "last.pt") == "step-00000040.1.dcp"
        and load_checkpoint(directory / "last.pt")["epoch"] == 1
    )
    best = load_checkpoint(directory / "best.pt")
    assert all(torch.equal(best["model"][k], v) for k, v in best_weights.items())

    shutil.rmtree(directory / "step-00000040.1.dcp")  # e.g. moved away by hand
    found, ckpt = load_resume_checkpoint(cfg)
    assert found == directory / "step-00000040.dcp" and ckpt["epoch"] == 0
    assert (
        f"warning: checkpoint '{directory / 'last.pt'}' not found; trying an older checkpoint"
        in capsys.readouterr().out
    )


def test_metadata_of_a_newer_torch_is_named_so(tmp_path, monkeypatch):
    """A class a newer torch's DCP has and this one lacks is not code: say which torch."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata

    class FutureStorageMetadata:
        pass

    FutureStorageMetadata.__module__ = "torch.distributed.checkpoint.metadata"
    FutureStorageMetadata.__qualname__ = "FutureStorageMetadata"
    _, folder = sharded_checkpoint(tmp_path)
    metadata = FileSystemReader(folder).read_metadata()  # our own file: safe to unpickle
    metadata.planner_data = FutureStorageMetadata()
    with monkeypatch.context() as patch:  # as if this torch had it, for pickle to name it
        patch.setattr(dcp_metadata, "FutureStorageMetadata", FutureStorageMetadata, raising=False)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert str(caught.value) == (
        f"checkpoint '{folder / '.metadata'}' was written by a newer torch: it names "
        f"torch.distributed.checkpoint.metadata.FutureStorageMetadata, which torch {torch.__version__} lacks; "
        "load it with that torch, or re-export it there"
    )


def two_sharded_saves(tmp_path):
    """A sharded run's folder (1 process) at steps 2 and 4; last.pt links to step 4's."""
    state, _ = make_state()
    cfg = run_dir_config(tmp_path, "fsdp.enabled=true")
    state.register("fsdp", fsdp.build(cfg, DistEnv()))  # its checkpoints are folders
    checkpointer = Checkpointer(cfg, DistEnv(), torch.device("cpu"))
    for step in (2, 4):
        state.step = step
        checkpointer.save(state)
    return cfg, checkpointer.directory


@pytest.mark.parametrize("damage", ["truncate", "delete", "delete_run_state"])
def test_a_torn_shard_is_refused_and_auto_resume_takes_the_older_folder(tmp_path, capsys, damage):
    cfg, directory = two_sharded_saves(tmp_path)
    folder = directory / "step-00000004.dcp"
    shard = next(folder.glob("*.distcp"))
    if damage == "truncate":
        size = shard.stat().st_size
        os.truncate(shard, size // 2)
        reason = f"is truncated: {shard.name} has {size // 2} of its {size} bytes"
    else:
        lost = shard if damage == "delete" else folder / "run_state.pt"
        lost.unlink()
        reason = f"is incomplete: it has no {lost.name}"
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, tensors=False)
    assert str(caught.value) == f"checkpoint '{folder}' {reason}; use another checkpoint"
    found, ckpt = load_resume_checkpoint(cfg)
    assert found == directory / "step-00000002.dcp" and ckpt["step"] == 2
    assert capsys.readouterr().out == (
        f"warning: checkpoint '{directory / 'last.pt'}' {reason}; trying an older checkpoint\n"
    )


def test_a_torn_shard_on_2_processes_is_one_line_or_the_older_folder(tmp_path):
    """FSDP on 2 processes: an explicit path fails in one line (evaluate.py aborted in
    gloo before), resume=auto continues from the intact older folder."""
    out = tmp_path / "run"
    args = [*FAST, "data.train_size=256", "fsdp.enabled=true", "checkpoint.every_steps=2", f"output_dir={out}"]
    run_script("train.py", [*args, "train.stop_at_step=4"], nproc=2)
    directory = out / "checkpoints"
    torn = directory / os.readlink(directory / "last.pt")
    shard = torn / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    for script, script_args in (
        ("evaluate.py", ["--checkpoint", torn]),
        ("train.py", [*FAST, f"output_dir={tmp_path / 'other'}", f"checkpoint.resume={torn}"]),
    ):
        result = run_script(script, script_args, nproc=2, check=False)
        assert one_error_line(result).startswith(f"error: checkpoint '{torn}' is truncated: __1_0.distcp has "), script
    resumed = run_script("train.py", [*args, "train.stop_at_step=6"], nproc=2)
    assert f"resumed from {directory / 'step-00000002.dcp'}: epoch 0, step 2" in resumed.stdout
    assert "is truncated: __1_0.distcp" in resumed.stdout


# -- a 2-process sharded checkpoint on other layouts and in every entry point ------------------


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
state = train.load_train_objs(cfg, env, device, checkpointer, train.build_parts(cfg, env), None)[2]
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


# -- processes killed mid-save, hostile folders given to train.py ------------------------------


# train.py whose rank 1 hangs once it has written its shards of step 4's folder: the save
# is midway (rank 0 waits for it) when the test kills every process.
HANGS_IN_SHARDED_SAVE = """
import os, sys, time
sys.path.insert(0, os.getcwd())
from torch.distributed.checkpoint import FileSystemWriter
import train

write_data = FileSystemWriter.write_data

def write_then_hang(self, plan, planner):
    written = write_data(self, plan, planner)
    if os.environ["RANK"] == "1" and "step-00000004" in str(self.path):
        print("shards written", flush=True)
        time.sleep(300)
    return written

FileSystemWriter.write_data = write_then_hang
train.main(sys.argv[1:])
"""


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_processes_killed_mid_sharded_save_leave_the_previous_checkpoint(tmp_path):
    out, script = tmp_path / "run", tmp_path / "hangs_in_save.py"
    script.write_text(HANGS_IN_SHARDED_SAVE)
    args = [*FAST, "fsdp.enabled=true", "checkpoint.every_steps=2", "train.stop_at_step=6", f"output_dir={out}"]
    run = subprocess.Popen(
        command(str(script), args, nproc=2),
        cwd=machinery_project(),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    wait_for_line(run, "shards written", seen)
    ranks = children(run.pid)  # each in a process group of its own
    for pid in (run.pid, *ranks):  # all at once, as a node failure would
        os.kill(pid, signal.SIGKILL)
    run.wait()
    wait_until_gone(ranks)  # the run lock names rank 0's process
    directory = out / "checkpoints"
    assert [p.name for p in step_checkpoints(directory)] == ["step-00000002.dcp"]
    assert (directory / ".step-00000004.dcp.tmp").is_dir(), "the torn save should still be on disk"
    assert last(out)["step"] == 2
    resumed = run_script("train.py", args, nproc=2)
    assert f"resumed from {directory / 'last.pt'}: epoch 0, step 2" in resumed.stdout
    assert last(out)["step"] == 6 and not list(directory.glob(".*.tmp"))  # cleaned by the next save


def wait_until_gone(pids: list[int], timeout=30) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} still there {timeout} s after SIGKILL"
        time.sleep(0.1)


def test_sharded_checkpoint_that_runs_code_is_refused_by_train_py(tmp_path):
    """A sharded checkpoint's .metadata is a pickle too: hostile ones end in one line."""
    out, marker = tmp_path / "run", tmp_path / "pwned"
    run_script("train.py", [*FAST, "fsdp.enabled=true", "train.stop_at_step=2", f"output_dir={out}"], nproc=2)
    folder = out / "checkpoints" / "step-00000002.dcp"
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file: safe to unpickle
    metadata.storage_meta.modules = [RunsSystem(marker)]  # os.system: the posix.system named below
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    for script, args in (
        ("train.py", [*FAST, f"output_dir={tmp_path / 'other'}", f"checkpoint.resume={folder}"]),
        ("evaluate.py", ["--checkpoint", folder]),
        ("export.py", ["--checkpoint", folder, "--out", tmp_path / "weights.pt"]),
    ):
        result = run_script(script, args, check=False)
        assert result.returncode == 2, script
        assert result.stderr == f"error: checkpoint '{folder / '.metadata'}' holds code (posix.system); refused\n"
    assert not marker.exists() and not (tmp_path / "weights.pt").exists()


# -- DDP and FSDP resume each other; what each rank holds --------------------------------------


def test_fsdp_and_ddp_resume_each_other(tmp_path):
    ddp, mixed = tmp_path / "ddp", tmp_path / "mixed"
    args = [*FAST, "train.epochs=1"]
    run_script("train.py", [*args, f"output_dir={ddp}"], nproc=2)
    run_script("train.py", [*args, f"output_dir={mixed}", "fsdp.enabled=true", "train.stop_at_step=10"], nproc=2)
    run_script("train.py", [*args, f"output_dir={mixed}", "fsdp.enabled=false", "train.stop_at_step=20"], nproc=2)
    last = run_script("train.py", [*args, f"output_dir={mixed}", "fsdp.enabled=true", "fsdp.cpu_offload=true"], nproc=2)
    assert "cpu, fsdp" in last.stdout
    a = load_checkpoint(ddp / "checkpoints" / "last.pt")
    b = load_checkpoint(mixed / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 32
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert (mixed / "checkpoints" / "last.pt").is_dir()  # FSDP's checkpoints are sharded folders
    run_state = mixed / "checkpoints" / "last.pt" / "run_state.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(run_state)) == []
    assert read_metrics(mixed)[0]["num_samples"] == 101
    # The memory report (a part, when the project has it) shows each rank's share: FSDP's
    # shards are half of DDP's replica.
    if "memory" not in read_metrics(ddp)[0]:
        return
    replica, shards = read_metrics(ddp)[0]["memory"], read_metrics(mixed)[0]["memory"]
    for ddp_rank, fsdp_rank in zip(replica, shards, strict=True):
        for key in ("params_mib", "optimizer_mib"):
            assert fsdp_rank[key] == pytest.approx(ddp_rank[key] / 2, rel=0.1), (key, ddp_rank, fsdp_rank)


SHARDED_SETUP = [*FAST, "model.name=resnet18", "data.image_size=8", "fsdp.enabled=true", "optim.name=adamw"]


def run_sharded_setup(out, nproc, *args):
    """tests/sharded_setup.py's per-rank figures, buffers, and (rank 0's) gathered weights."""
    out.mkdir()
    script = str(PROJECT / "tests" / "sharded_setup.py")
    run_script(script, [out, *args, *SHARDED_SETUP], nproc=nproc, env={"PYTHONPATH": str(machinery_project())})
    ranks = nproc or 1
    held = [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(ranks)]
    buffers = [torch.load(out / f"buffers_{rank}.pt") for rank in range(ranks)]
    return held, buffers, torch.load(out / "weights.pt")


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_setup_holds_shards_only_and_starts_from_the_single_process_weights(tmp_path, nproc):
    """Each rank holds ~1/N of the parameters and of AdamW's state, and the weights
    gathered back (BatchNorm statistics included) are bitwise those one process builds."""
    _, single_buffers, single = run_sharded_setup(tmp_path / "single", None)
    held, buffers, weights = run_sharded_setup(tmp_path / "sharded", nproc)
    assert weights.keys() == single.keys()
    for key, value in single.items():
        assert torch.equal(weights[key], value), key
    for rank_buffers in buffers:
        assert all(torch.equal(rank_buffers[name], value) for name, value in single_buffers[0].items())
    full = held[0]["full_params"]
    for rank in held:
        assert 0.9 * full / nproc < rank["params"] < 1.1 * full / nproc, (rank, full)
        assert 1.8 * full / nproc < rank["optimizer"] < 2.2 * full / nproc, (rank, full)  # AdamW: 2 moments


@pytest.mark.parametrize("nproc", [2, 4])
def test_under_fsdp_no_rank_holds_a_full_copy_beyond_rank_0s_setup(tmp_path, nproc):
    """A 24-block MLP (100 MiB of weights), with train.py's host-memory setting; peaks
    above each phase's start. No rank other than 0 ever holds a full copy, no rank does
    while saving, and every rank's step holds its shards plus a block or so. Rank 0
    builds the model in host memory once, by design (exact initial weights for any
    build_model): its setup peak is that copy and its shard, no more."""
    held, _, _ = run_sharded_setup(tmp_path / "deep", nproc, "--deep-mlp")
    full_mib = held[0]["full_params"] / 2**20
    shard_mib = full_mib / nproc
    for rank in held:
        assert rank["save_peak_mib"] < 0.25 * full_mib, rank  # every rank writes its own shards
        # Gradients and AdamW's two moments of its shard, plus gathered blocks and activations:
        # 73-98 MiB measured at 4 processes (a heap that keeps FSDP's blocks: 420-460).
        assert rank["step_peak_mib"] < 3 * shard_mib + 0.5 * full_mib, rank
    for rank in held[1:]:
        # Less than one copy: its shard and a tensor at a time (44-76 MiB measured of 97).
        assert rank["setup_peak_mib"] < full_mib, rank
    assert full_mib < held[0]["setup_peak_mib"] < 1.2 * (full_mib + shard_mib), held[0]


# The reference task's model.py with build_model replaced by a deep MLP: 12 blocks of
# 4 MiB weights (49 MiB in all), each below glibc's largest adaptive mmap threshold (32 MiB).
DEEP_MLP = """

def build_model(cfg) -> nn.Module:
    stem = nn.Linear(3 * cfg.data.image_size**2, 1024)
    blocks = [MLPBlock(1024, 1024, 0.0) for _ in range(12)]
    return nn.Sequential(nn.Flatten(), stem, *blocks, nn.Linear(1024, count_classes(cfg)))
"""

# train.py as it runs, with what each rank holds in the C heap (tensors, and what glibc
# keeps of what was freed: the memory report's heap_used_mib and heap_kept_mib) once its
# process group is up (the baseline) and when its first step begins.
FIRST_STEP_HEAP = """
import json, os, runpy, sys
import engine.distributed, engine.training
from engine.parts.memory import c_heap_mib

held = {}
real_init, real_forward_backward = engine.distributed.init_distributed_mode, engine.training.forward_backward

def heap_mib():
    figures = c_heap_mib()
    return figures["heap_used_mib"] + figures["heap_kept_mib"]

def init_distributed_mode(*args, **kwargs):
    env_and_device = real_init(*args, **kwargs)
    held["baseline_mib"] = heap_mib()
    return env_and_device

def forward_backward(state, *args, **kwargs):
    if "first_step_mib" not in held:
        held["first_step_mib"] = heap_mib()
        held["full_mib"] = sum(p.numel() * p.element_size() for p in state.model.parameters()) / 2**20
        with open(os.path.join(os.path.dirname(__file__), "held" + os.environ["RANK"]), "w") as f:
            json.dump(held, f)
    return real_forward_backward(state, *args, **kwargs)

engine.distributed.init_distributed_mode = init_distributed_mode
engine.training.forward_backward = forward_backward
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator and mallinfo2")
@pytest.mark.skipif(not has("engine/parts/memory.py"), reason="measured with the memory_report part's heap figures")
@pytest.mark.parametrize("nproc", [2, 4])
def test_under_fsdp_no_rank_but_0_holds_more_than_its_shard_when_its_first_step_begins(tmp_path, nproc):
    """With the launch's allocator defaults (no MALLOC_*): FSDP's setup hands every rank
    each full tensor in turn, and what it frees must go back, not stay in the heap. Each
    rank but 0 holds at most its shard and a quarter of the weights above its baseline
    (measured 0.27x at 4 processes and 0.52x at 2; 1.4-2.7x when the setting came
    after setup)."""
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project)
    (project / "model.py").write_text((project / "model.py").read_text() + DEEP_MLP)
    (project / "first_step_heap.py").write_text(FIRST_STEP_HEAP)
    args = [*FAST, "fsdp.enabled=true", "train.stop_at_step=1", f"output_dir={tmp_path / 'run'}"]
    run_script(str(project / "first_step_heap.py"), args, nproc=nproc, cwd=project)
    held = [json.loads((project / f"held{rank}").read_text()) for rank in range(nproc)]
    assert held[0]["full_mib"] > 45, held[0]  # the deep MLP's weights
    full_mib = held[0]["full_mib"]
    for rank in held[1:]:
        above_baseline = rank["first_step_mib"] - rank["baseline_mib"]
        assert above_baseline <= full_mib / nproc + 0.25 * full_mib, (rank, above_baseline / full_mib)


def test_a_model_that_reads_its_values_while_built_names_the_fsdp_setup():
    def build():
        model = torch.nn.Linear(2, 2)
        model.bias.data *= model.weight.abs().max().item()  # reads a value: impossible on meta
        return model

    assert build_on_meta(lambda: torch.nn.Linear(2, 2)).weight.is_meta
    with pytest.raises(TaskError, match="meta device, which FSDP's setup uses"):
        build_on_meta(build)
