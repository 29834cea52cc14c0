import dataclasses
import os
import pickle
import shutil

import pytest
import torch

from conftest import FAST, read_metrics, reference_config, reference_task, run_script
from engine.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    load_model_weights,
    load_resume_checkpoint,
    save_checkpoint,
    step_checkpoints,
    strip_prefixes,
)
from engine.distributed import DistEnv
from engine.divergence import NonFiniteGuard
from engine.optim import build_grad_scaler, build_optimizer, build_scheduler
from engine.seeding import capture_rng_state
from engine.sharded import load_full, load_sharded, save_sharded, sharded_state_dict
from engine.training import TrainState

MLP = reference_task().model.MLP


def make_state(seed=0):
    torch.manual_seed(seed)
    model = MLP(12, 8, 3)
    cfg = reference_config(None, ["train.optimizer=adamw"])
    optimizer = build_optimizer(model, cfg.train, cfg.train.lr)
    model(torch.randn(4, 12)).sum().backward()
    optimizer.step()  # creates optimizer state tensors
    scheduler = build_scheduler(optimizer, cfg.train, steps_per_epoch=10)
    cpu = torch.device("cpu")
    guard = NonFiniteGuard(cfg.train, last_good=lambda: "", lr=cfg.train.lr, device=cpu)
    return TrainState(model, model, optimizer, scheduler, build_grad_scaler("fp32", cpu), guard, cpu), cfg


def payload(state, cfg):
    return {**state.state_dict(), "config": dataclasses.asdict(cfg), "world_size": 1, "rng": [capture_rng_state()]}


def test_round_trip_is_plain_data(tmp_path):
    state, cfg = make_state()
    path = save_checkpoint(payload(state, cfg), tmp_path, step=7, keep_last=2, is_best=True)
    assert path.name == "step-00000007.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state.model.state_dict().items())
    assert loaded["config"] == dataclasses.asdict(cfg)
    other, _ = make_state(seed=1)
    load_model_weights(other.model, loaded["model"], "last.pt")
    other.load_state_dict(loaded)
    assert torch.equal(
        other.optimizer.state_dict()["state"][0]["exp_avg"], state.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert (tmp_path / "best.pt").read_bytes() == path.read_bytes()


def test_keeps_the_newest_step_checkpoints_and_no_temporary_files(tmp_path):
    state, cfg = make_state()
    (tmp_path / ".last.pt.abc.tmp").write_bytes(b"torn")  # as left by a killed save
    for step in range(1, 6):
        save_checkpoint(payload(state, cfg), tmp_path, step=step, keep_last=2, is_best=False)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000004.pt", "step-00000005.pt"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 0


def test_wrapper_prefixes_are_stripped():
    weights = {"module._orig_mod.net.1.linear.weight": 1, "net.3.bias": 2}
    assert strip_prefixes(weights) == {"net.1.linear.weight": 1, "net.3.bias": 2}


def test_mismatched_model_names_key_and_shapes():
    small, big = MLP(12, 8, 3), MLP(12, 16, 3)
    with pytest.raises(
        CheckpointError, match=r"'net.2.linear.weight' has shape \(16, 12\) in the checkpoint but \(8, 12\)"
    ):
        load_model_weights(small, big.state_dict(), "x.pt")


def test_garbage_and_truncated_files_are_refused(tmp_path):
    state, cfg = make_state()
    good = save_checkpoint(payload(state, cfg), tmp_path, step=1, keep_last=3, is_best=False)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1000])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    for path in (truncated, garbage, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointError, match=str(path.name)):
            load_checkpoint(path)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": RunsCode(marker)}, evil, pickle_module=pickle)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_checkpoint(evil)
    assert not marker.exists()


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
    cfg = reference_config(None, ["train.strategy=fsdp", "checkpoint.best_metric=val_loss", f"output_dir={tmp_path}"])
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


def test_best_checkpoint_follows_best_metric_and_mode(tmp_path):
    args = [*FAST, "train.epochs=3", "data.train_size=512", "checkpoint.best_metric=val_loss"]
    best_steps = {}
    for mode, pick in (("min", min), ("max", max)):
        out = tmp_path / mode
        run_script("train.py", [*args, f"checkpoint.best_mode={mode}", f"output_dir={out}"])
        epochs = read_metrics(out)
        losses = [m["val_loss"] for m in epochs]
        best_epoch = losses.index(pick(losses))  # the first epoch that reached the best value
        best = load_checkpoint(out / "checkpoints" / "best.pt")
        assert (best["step"], best["best_metric_value"]) == (epochs[best_epoch]["step"], losses[best_epoch])
        best_steps[mode] = best["step"]
    assert best_steps["min"] != best_steps["max"]  # the mode decides


def test_an_unknown_best_metric_is_one_line_naming_the_choices(tmp_path):
    args = [*FAST, "train.epochs=1", "data.train_size=256", "checkpoint.best_metric=val_f1"]
    result = run_script("train.py", [*args, f"output_dir={tmp_path / 'run'}"], nproc=2, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors == [
        "error: checkpoint.best_metric is 'val_f1', which this task does not report (it reports val_loss, "
        "val_acc); set checkpoint.best_metric to one of them"
    ], result.stderr
