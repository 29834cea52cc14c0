import pickle

import pytest
import torch

from checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    step_checkpoints,
    strip_prefixes,
)
from config import load_config, to_dict
from engine import TrainState
from model import MLP
from optim import build_grad_scaler, build_optimizer, build_scheduler
from seeding import capture_rng_state


def make_state(seed=0):
    torch.manual_seed(seed)
    model = MLP(12, 8, 3)
    cfg = load_config(None, ["train.optimizer=adamw"])
    optimizer = build_optimizer(model, cfg.train)
    model(torch.randn(4, 12)).sum().backward()
    optimizer.step()  # creates optimizer state tensors
    scheduler = build_scheduler(optimizer, cfg.train, steps_per_epoch=10)
    return TrainState(model, model, optimizer, scheduler, build_grad_scaler("fp32", torch.device("cpu"))), cfg


def payload(state, cfg):
    return {**state.state_dict(), "config": to_dict(cfg), "world_size": 1, "rng": [capture_rng_state()]}


def test_round_trip_is_plain_data(tmp_path):
    state, cfg = make_state()
    path = save_checkpoint(payload(state, cfg), tmp_path, step=7, keep_last=2, is_best=True)
    assert path.name == "step-00000007.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state.model.state_dict().items())
    assert loaded["config"] == to_dict(cfg)
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
        CheckpointError, match=r"'net.1.linear.weight' has shape \(16, 12\) in the checkpoint but \(8, 12\)"
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
