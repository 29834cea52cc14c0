import itertools
import os
import pickle
import shutil
import subprocess
import zipfile
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import safetensors.torch
import torch

from conftest import (
    FAST,
    STRATEGIES,
    clean_env,
    command,
    machinery_project,
    read_metrics,
    reference_config,
    reference_task,
    run_script,
)
from engine.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpointer,
    CheckpointError,
    config_changes,
    load_checkpoint,
    load_model_state,
    load_model_weights,
    load_resume_checkpoint,
    refuse_changed_settings,
    save_checkpoint,
    step_checkpoints,
    strip_prefixes,
    weight_sets,
)
from engine.config import Config
from engine.distributed import DistEnv
from engine.files import WriteErrors, private_folder
from engine.seeding import capture_rng_state
from engine.training import NonFiniteGuard, TrainState, build_grad_scaler

MLP = reference_task().model.MLP
RECIPE = reference_task().recipe


def make_state(seed=0):
    torch.manual_seed(seed)
    model = MLP(12, 8, 3)
    cfg = reference_config(None, ["optim.name=adamw"])
    optimizer = RECIPE.build_optimizer(model, cfg, 1, {})
    model(torch.randn(4, 12)).sum().backward()
    optimizer.step()  # creates optimizer state tensors
    scheduler = RECIPE.build_scheduler(optimizer, cfg, steps_per_epoch=10)
    cpu = torch.device("cpu")
    guard = NonFiniteGuard(cfg.train, last_good=lambda: "", lr=cfg.optim.lr, device=cpu)
    return TrainState(model, model, optimizer, scheduler, build_grad_scaler("fp32", cpu), guard, cpu), cfg


def payload(state, cfg):
    return {**state.state_dict(), "config": cfg.to_dict(), "world_size": 1, "rng": [capture_rng_state()]}


def test_round_trip_is_plain_data(tmp_path):
    state, cfg = make_state()
    path = save_checkpoint(payload(state, cfg), tmp_path, step=7, keep_last=2, is_best=True)
    assert path.name == "step-00000007.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state.model.state_dict().items())
    assert loaded["config"] == cfg.to_dict()
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


def test_prune_leaves_the_temporary_file_of_another_live_process_alone(tmp_path):
    """A save in flight beside this run (another live process of this host) keeps its file; a dead one's goes."""
    state, cfg = make_state()
    writer, gone = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["true"])
    gone.wait()
    try:
        in_flight = tmp_path / f".step-00000009.pt.pid{writer.pid}.abc.tmp"
        leftover = tmp_path / f".step-00000008.pt.pid{gone.pid}.abc.tmp"
        for path in (in_flight, leftover):
            path.write_bytes(b"half")
        save_checkpoint(payload(state, cfg), tmp_path, step=1, keep_last=1, is_best=False)
        assert in_flight.exists() and not leftover.exists()
    finally:
        writer.kill()
        writer.wait()


def test_a_folder_named_like_a_leftover_never_stops_a_save(tmp_path):
    """A '.*.tmp' folder in checkpoints/ (another tool's, or a deletion cut short) is no
    file of a save: saving and pruning go on beside it."""
    state, cfg = make_state()
    (tmp_path / ".step-00000009.dcp.del.tmp").mkdir()
    for step in range(1, 4):
        save_checkpoint(payload(state, cfg), tmp_path, step=step, keep_last=1, is_best=False)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000003.pt"]


def test_wrapper_prefixes_are_stripped():
    weights = {"module._orig_mod.net.1.linear.weight": 1, "net.3.bias": 2}
    assert strip_prefixes(weights) == {"net.1.linear.weight": 1, "net.3.bias": 2}


def test_mismatched_model_names_key_and_shapes():
    small, big = MLP(12, 8, 3), MLP(12, 16, 3)
    with pytest.raises(
        CheckpointError, match=r"'net.2.linear.weight' has shape \(16, 12\) in the checkpoint but \(8, 12\)"
    ):
        load_model_weights(small, big.state_dict(), "x.pt")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_weights_of_another_kind_of_number_are_refused_by_name(dtype):
    """The one check every load of weights goes through (a checkpoint, resume, init_from,
    export's files): right shapes of integers or booleans would load as nonsense."""
    model = MLP(12, 8, 3)
    weights = {key: value.to(dtype) for key, value in model.state_dict().items()}
    expected = rf"x.safetensors: 'net.2.linear.weight' holds {dtype} in the checkpoint but torch.float32 in the model"
    with pytest.raises(CheckpointError, match=expected):
        load_model_weights(model, weights, "x.safetensors")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_floating_point_weights_of_another_precision_load_converted(dtype):
    source, model = MLP(12, 8, 3), MLP(12, 8, 3)
    load_model_weights(model, {key: value.to(dtype) for key, value in source.state_dict().items()}, "x.pt")
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, source.state_dict()[key].to(dtype).float())


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


# -- checkpoints that are not usable: one line naming the file and what to do ---------------


def one_error_line(result) -> str:
    """The run's only `error:` line; no traceback, no abort."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr and "Fatal Python error" not in result.stderr, result.stderr
    return errors[0]


def assert_short(message: str, path) -> None:
    """One line of about 200 characters, besides the path it names."""
    assert "\n" not in message and str(path) in message
    assert len(message.replace(str(path), "")) <= 200, message


def run_dir_config(tmp_path, *overrides):
    return reference_config(None, [f"output_dir={tmp_path}", *overrides])


def save_steps(directory, steps):
    """.pt step checkpoints of a run, each holding its own step; last.pt is the newest."""
    state, cfg = make_state()
    for step in steps:
        state.step = step
        save_checkpoint(payload(state, cfg), directory, step=step, keep_last=len(steps), is_best=False)


def test_auto_resume_refuses_a_last_pt_that_links_elsewhere(tmp_path):
    """last.pt replaced by a link to an older checkpoint outside the run: continuing from it
    would overwrite step-00000016.pt and prune the newer ones. One line, nothing touched."""
    out = tmp_path / "run"
    args = [*FAST, "data.train_size=128", "checkpoint.every_steps=4", f"output_dir={out}"]
    run_script("train.py", [*args, "train.epochs=2"])
    directory = out / "checkpoints"
    old = tmp_path / "old.pt"
    shutil.copy(directory / "step-00000008.pt", old)
    (directory / "last.pt").unlink()
    (directory / "last.pt").symlink_to(old)
    before = {path.name: path.read_bytes() for path in step_checkpoints(directory)}
    assert "step-00000016.pt" in before
    result = run_script("train.py", [*args, "train.epochs=3"], check=False)
    assert result.returncode == 2 and "resumed from" not in result.stdout
    assert one_error_line(result) == (
        f"error: checkpoint '{directory / 'last.pt'}' links to '{old}', not to a step-*.dcp folder beside it; "
        "remove it to continue from the newest step checkpoint, or set checkpoint.resume=PATH"
    )
    assert {path.name: path.read_bytes() for path in step_checkpoints(directory)} == before
    assert [row["epoch"] for row in read_metrics(out)] == [0, 1]


@pytest.mark.parametrize("target", ["step-00000008.pt", "../checkpoints/step-00000008.dcp", "elsewhere.dcp"])
def test_auto_resume_refuses_links_train_py_never_makes(tmp_path, target):
    """A .pt run's last.pt is a hard link; a sharded run's (the fsdp part) a relative link to a
    step-*.dcp folder beside it. Any other link is refused, even one into the same folder."""
    directory = tmp_path / "checkpoints"
    save_steps(directory, [8, 16])
    (directory / "last.pt").unlink()
    (directory / "last.pt").symlink_to(target)
    refused = r"links to '.*', not to a step-\*\.dcp folder beside it; remove it"
    with pytest.raises(CheckpointError, match=refused):
        load_resume_checkpoint(run_dir_config(tmp_path))


def test_auto_resume_refuses_a_last_pt_older_than_a_step_checkpoint_beside_it(tmp_path):
    """last.pt a hard link to an older step: replaced by hand, or left by a run that went
    back to an older checkpoint (checkpoint.resume=PATH) and was stopped before it reached
    the newer ones. Continuing from either would overwrite step-00000016.pt: one line."""
    directory = tmp_path / "checkpoints"
    save_steps(directory, [8, 12, 16])
    (directory / "last.pt").unlink()
    os.link(directory / "step-00000012.pt", directory / "last.pt")
    with pytest.raises(CheckpointError) as caught:
        load_resume_checkpoint(run_dir_config(tmp_path))
    assert str(caught.value) == (
        f"checkpoint '{directory / 'last.pt'}' is step 12, but step-00000016.pt beside it is newer; "
        "remove it to continue from the newest step checkpoint, or set checkpoint.resume=PATH"
    )
    assert [path.name for path in step_checkpoints(directory)] == [f"step-{n:08d}.pt" for n in (8, 12, 16)]
    (directory / "last.pt").unlink()  # as the line says
    found, ckpt = load_resume_checkpoint(run_dir_config(tmp_path))
    assert found == directory / "step-00000016.pt" and ckpt["step"] == 16


def test_auto_resume_takes_last_pt_when_it_is_the_newest(tmp_path, capsys):
    """A copy (file systems without hard links) or a run whose step files were moved away."""
    directory = tmp_path / "checkpoints"
    save_steps(directory, [8, 16])
    (directory / "last.pt").unlink()
    shutil.copy(directory / "step-00000016.pt", directory / "last.pt")
    (directory / "step-00000016.pt").unlink()
    found, ckpt = load_resume_checkpoint(run_dir_config(tmp_path))
    assert found == directory / "last.pt" and ckpt["step"] == 16
    assert capsys.readouterr().out == ""


NOT_OURS = "is not a checkpoint of this project"


def other_formats(tmp_path) -> dict:
    """Checkpoint-like dicts of other programs or versions, and the reason each is refused."""
    state, cfg = make_state()
    good = payload(state, cfg)
    cases = {
        "no_config": ({k: v for k, v in good.items() if k != "config"}, f"{NOT_OURS} (no 'config')"),
        "no_step": ({k: v for k, v in good.items() if k != "step"}, f"{NOT_OURS} (no 'step')"),
        "model_tensor": (
            {**good, "model": torch.ones(3)},
            f"{NOT_OURS} ('model' is a Tensor, not a dict)",
        ),
        "model_lists": (
            {**good, "model": {"net.0.weight": [1.0, 2.0]}},
            f"{NOT_OURS} ('model' holds 'net.0.weight': a list, not a tensor)",
        ),
        "step_text": ({**good, "step": "16"}, f"{NOT_OURS} ('step' is a str, not an int)"),
        "newer": (
            {**good, "format_version": 1000},
            "was written by a newer version of this project "
            f"(format 1000; this one reads up to {CHECKPOINT_FORMAT}); use that version",
        ),
    }
    paths = {}
    for name, (contents, reason) in cases.items():
        torch.save(contents, tmp_path / f"{name}.pt")
        paths[name] = (tmp_path / f"{name}.pt", reason)
    return paths


def test_one_validation_refuses_other_formats_in_one_line(tmp_path):
    for path, reason in other_formats(tmp_path).values():
        for load in (load_checkpoint, lambda p: load_checkpoint(p, tensors=False), load_model_state):
            with pytest.raises(CheckpointError) as caught:
                load(path)
            assert str(caught.value).startswith(f"checkpoint '{path}' {reason}"), str(caught.value)
            assert_short(str(caught.value), path)


def test_new_checkpoints_carry_their_format_and_older_ones_still_load(tmp_path):
    state, _ = make_state()
    cfg = run_dir_config(tmp_path)
    Checkpointer(cfg, DistEnv(), torch.device("cpu")).save(state)
    written = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert isinstance(written["format_version"], int)
    older = {k: v for k, v in written.items() if k != "format_version"}
    torch.save(older, tmp_path / "older.pt")
    assert load_checkpoint(tmp_path / "older.pt")["step"] == written["step"]


ENTRY_POINTS = {
    "resume": lambda path, out: ("train.py", [*FAST, f"output_dir={out}", f"checkpoint.resume={path}"]),
    "init_from": lambda path, out: ("train.py", [*FAST, f"output_dir={out}", f"checkpoint.init_from={path}"]),
    "evaluate": lambda path, out: ("evaluate.py", ["--checkpoint", path]),
    "export": lambda path, out: ("export.py", ["--checkpoint", path, "--out", out / "weights.pt"]),
}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_entry_point_refuses_other_formats_in_one_line(tmp_path, entry_point):
    cases = other_formats(tmp_path)
    for name in ("no_config", "model_tensor", "newer"):
        path, reason = cases[name]
        script, args = ENTRY_POINTS[entry_point](path, tmp_path / "out")
        result = run_script(script, args, check=False)
        assert result.returncode == 2 and one_error_line(result).startswith(f"error: checkpoint '{path}' {reason}")


@pytest.mark.skipif("fsdp" in STRATEGIES, reason="with FSDP a folder is a checkpoint: tests/test_fsdp.py")
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_without_fsdp_every_entry_point_refuses_a_folder_in_one_line(tmp_path, entry_point):
    """A project generated without FSDP reads .pt files only: another project's folder of
    shards (or any folder) is refused before anything is read."""
    folder = tmp_path / "step-00000002.dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"never read")
    script, args = ENTRY_POINTS[entry_point](folder, tmp_path / "out")
    result = run_script(script, args, check=False)
    assert result.returncode == 2 and one_error_line(result) == (
        f"error: checkpoint '{folder}' is a folder, and this project reads .pt files only (folders of shards "
        "come with the fsdp answer when it is generated); use a .pt checkpoint"
    )


class RunsSystem:
    """A plain pickle (pickle.dumps) that would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unusable_files_are_named_for_what_they_are(tmp_path):
    """Not torch's words (which suggest weights_only=False, or say "list index out of range"):
    what the file is and what to do."""
    state, cfg = make_state()
    good = save_checkpoint(payload(state, cfg), tmp_path, step=1, keep_last=3, is_best=False).read_bytes()
    files = {
        "hostile.pt": pickle.dumps(RunsSystem(tmp_path / "pwned")),
        "cut_early.pt": good[:1000],
        "cut_half.pt": good[: len(good) // 2],
        "cut_late.pt": good[:-10],
        "text.pt": b"hello world\n",
        "empty.pt": b"",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with zipfile.ZipFile(tmp_path / "archive.pt", "w") as archive:
        archive.writestr("notes.txt", "not weights")
    (tmp_path / "folder").mkdir()
    expected = {
        "hostile.pt": "holds code or objects other than plain data (posix.system); refused",
        **dict.fromkeys(["cut_early.pt", "cut_half.pt", "cut_late.pt"], "is truncated or corrupt"),
        "text.pt": "is not a checkpoint of this project (not a file torch.save writes)",
        "empty.pt": "is not a checkpoint of this project (an empty file)",
        "list.pt": "is not a checkpoint of this project (it holds a list, not a dict)",
        "archive.pt": "is not a checkpoint of this project (a zip archive torch.save did not write)",
        "folder": "is not a checkpoint of this project (a folder without .metadata or run_state.pt)"
        if "fsdp" in STRATEGIES
        else "is a folder, and this project reads .pt files only",
    }
    for name, reason in expected.items():
        path = tmp_path / name
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(path)
        message = str(caught.value)
        assert message.startswith(f"checkpoint '{path}' {reason}"), message
        assert "weights_only" not in message and "Errno" not in message and "index" not in message
        assert_short(message, path)
    assert not (tmp_path / "pwned").exists()


def test_a_ctrl_c_during_a_save_is_a_ctrl_c_not_a_disk_error(tmp_path, monkeypatch):
    """torch.save turns an exception raised in a write into RuntimeError("unexpected pos"):
    the save must raise the KeyboardInterrupt itself (report_errors: one line, exit 130)."""
    real_write, writes = WriteErrors.write, []

    def interrupted_write(self, data):
        writes.append(len(data))
        if len(writes) == 3:
            self.file.write = lambda _: (_ for _ in ()).throw(KeyboardInterrupt())  # the signal lands here
        return real_write(self, data)

    monkeypatch.setattr(WriteErrors, "write", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {"w": torch.ones(100_000)}, "step": 1}, tmp_path, 1, keep_last=3, is_best=False)
    assert not list(tmp_path.iterdir())  # nothing torn left behind


# -- resuming after the config's schema grew ---------------------------------------------------


@dataclass
class OldModel:
    """A task's model section as a checkpoint saved it."""

    hidden_dim: int = 32
    widths: tuple[int, ...] = (32, 64)


@dataclass
class Head:
    dropout: float = 0.0
    cache: str = ""

    may_change_on_resume: ClassVar[tuple[str, ...]] = ("cache",)


@dataclass
class GrownModel:
    """OldModel with settings added since: defaulted fields, before and after the old ones."""

    beta2: float | None = None
    hidden_dim: int = 32
    widths: tuple[int, ...] = (32, 64)
    bias: bool = True
    head: Head = field(default_factory=lambda: Head(dropout=0.5))


def config_of(model) -> Config:
    return Config(sections={"data": reference_task().data.DataConfig(), "model": model})


def saved_by(model) -> dict:
    return config_of(model).to_dict()


def test_a_setting_added_since_the_checkpoint_at_its_default_is_no_change():
    """The default keeps the old behaviour; a key the schema no longer has is ignored."""
    saved = saved_by(OldModel())
    saved["model"]["retired"] = 3
    assert config_changes(saved, config_of(GrownModel())) == []


def test_a_setting_added_since_the_checkpoint_away_from_its_default_is_refused(tmp_path):
    saved = saved_by(OldModel())
    assert config_changes(saved, config_of(GrownModel(bias=False))) == ["model.bias: new key, default True -> False"]
    assert config_changes(saved, config_of(GrownModel(head=Head(dropout=0.1)))) == [
        "model.head.dropout: new key, default 0.5 -> 0.1"
    ]
    with pytest.raises(CheckpointError) as caught:
        refuse_changed_settings(tmp_path / "last.pt", saved, config_of(GrownModel(beta2=0.95)))
    assert str(caught.value) == (
        f"{tmp_path / 'last.pt'} was trained with other settings (model.beta2: new key, default None -> 0.95); "
        f"use a new output_dir, or checkpoint.resume=none checkpoint.init_from={tmp_path / 'last.pt'} "
        "to start from its weights only"
    )


def test_the_refusal_names_first_what_the_user_changed(tmp_path):
    """Changed keys in schema order, then the new keys set away from their defaults."""
    saved = saved_by(OldModel())
    grown = GrownModel(beta2=0.95, hidden_dim=64, widths=(32, 128), bias=False)
    assert config_changes(saved, config_of(grown)) == [
        "model.hidden_dim: 32 -> 64",
        "model.widths: [32, 64] -> [32, 128]",
        "model.beta2: new key, default None -> 0.95",
        "model.bias: new key, default True -> False",
    ]
    with pytest.raises(CheckpointError, match=r"other settings \(model\.hidden_dim: 32 -> 64 and 3 more\); use"):
        refuse_changed_settings(tmp_path / "last.pt", saved, config_of(grown))


def test_saved_lists_equal_the_tuples_they_were():
    """A tuple field may come back as a list (or a tuple of tuples as lists of lists)."""

    @dataclass
    class Model:
        widths: tuple[int, ...] = (32, 64)
        grid: tuple[tuple[int, int], ...] = ((1, 2), (3, 4))

    saved = saved_by(Model())
    saved["model"] |= {"widths": [32, 64], "grid": [[1, 2], [3, 4]]}
    assert config_changes(saved, config_of(Model())) == []
    assert config_changes(saved, config_of(Model(grid=((1, 2), (3, 5))))) == [
        "model.grid: [[1, 2], [3, 4]] -> [[1, 2], [3, 5]]"
    ]


def test_a_nested_section_is_compared_key_by_key():
    saved = saved_by(GrownModel())
    saved["model"]["head"]["retired"] = 1  # removed from the schema since
    del saved["model"]["head"]["cache"]  # added since, at its default
    assert config_changes(saved, config_of(GrownModel())) == []
    changed = GrownModel(head=Head(dropout=0.1, cache="/tmp/cache"))  # cache may change on resume
    assert config_changes(saved, config_of(changed)) == ["model.head.dropout: 0.5 -> 0.1"]


def test_a_run_resumes_after_its_model_config_grew_a_defaulted_field(tmp_path):
    """A real run: trained, then its ModelConfig gains `bias: bool = True`; resuming continues."""
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project)
    out = tmp_path / "run"
    args = [*FAST, "data.train_size=128", f"output_dir={out}"]
    run_script("train.py", [*args, "train.epochs=1"], cwd=project)
    model_py = project / "model.py"
    old_field = "    dropout: float = 0.0  # mlp only"
    assert old_field in model_py.read_text()
    model_py.write_text(model_py.read_text().replace(old_field, f"{old_field}\n    bias: bool = True", 1))
    result = run_script("train.py", [*args, "train.epochs=2"], cwd=project)
    assert "resumed from" in result.stdout
    assert [row["epoch"] for row in read_metrics(out)] == [0, 1]


def test_export_writes_weights_safetensors_a_program_and_the_settings_of_the_same_model(tmp_path):
    """model.pt and model.safetensors load into the model that model.yaml builds, and it
    gives the checkpoint's model's outputs exactly; so does model.pt2 without model.py,
    on a batch of another size than the one it was traced from."""
    trained = tmp_path / "trained"
    run_script("train.py", [*FAST, "data.train_size=64", "train.epochs=1", f"output_dir={trained}"])
    checkpoint = trained / "checkpoints" / "last.pt"
    exported = tmp_path / "export" / "model.pt"
    shown = run_script("export.py", ["--checkpoint", checkpoint, "--out", exported, "--program"]).stdout
    assert shown.startswith(f"wrote {exported}: ") and "beside it model.safetensors, model.yaml and model.pt2" in shown

    cfg = reference_config(exported.with_suffix(".yaml"))
    assert cfg.model == reference_config(None, FAST).model
    task = reference_task()
    images = torch.stack([image for image, _ in itertools.islice(task.data.build_datasets(cfg)[1], 8)])
    outputs = []
    for weights in (
        load_checkpoint(checkpoint)["model"],
        torch.load(exported, weights_only=True),
        safetensors.torch.load_file(exported.with_suffix(".safetensors")),
    ):
        model = task.model.build_model(cfg).eval()
        model.load_state_dict(strip_prefixes(weights))  # strict: every name and shape
        with torch.no_grad():
            outputs.append(model(images))
    with torch.no_grad():
        outputs.append(torch.export.load(exported.with_suffix(".pt2")).module()(images))
    assert all(torch.equal(outputs[0], output) for output in outputs[1:])


@pytest.mark.parametrize(
    "umask, mode",
    [
        (0o002, 0o664),
        pytest.param(0o022, 0o644, marks=pytest.mark.slow),
        pytest.param(0o077, 0o600, marks=pytest.mark.slow),
    ],
)
def test_what_a_run_writes_honours_the_umask(tmp_path, umask, mode):
    """A group sharing the output folder (umask 002) can read the checkpoints and the config;
    a private umask keeps them private: files are created as by open(), never 0600 alone."""
    out = tmp_path / "run"
    args = [*FAST, "data.train_size=64", "train.epochs=1", "checkpoint.every_steps=1", f"output_dir={out}"]
    subprocess.run(
        command("train.py", args),
        cwd=machinery_project(),
        env=clean_env(),
        preexec_fn=lambda: os.umask(umask),
        check=True,
        capture_output=True,
    )
    written = [out / "config.yaml", out / "metrics.jsonl", *(out / "checkpoints").glob("*.pt")]
    assert len(written) > 4 and {path: path.stat().st_mode & 0o777 for path in written} == dict.fromkeys(written, mode)
    mine = os.umask(umask)  # this process's, for the hidden folders that become checkpoints and predictions
    try:
        assert private_folder(tmp_path / "parts").stat().st_mode & 0o777 == mode | (mode & 0o444) >> 2
    finally:
        os.umask(mine)


def test_the_weight_sets_of_a_checkpoint_are_those_it_lists_or_before_format_2_its_dicts_of_tensors():
    """Format 1 listed no sets: a part's weights (an average) were a dict of tensors at the
    top, beside dicts of other things (the optimizer's, a part's counters)."""
    tensor = torch.ones(2)
    state = {
        "model": {"w": tensor},
        "average": {"w": tensor},
        "optimizer": {"state": {}, "param_groups": []},
        "scaler": {},
        "early_stop": {"best": 1.0},
    }
    assert weight_sets(state) == ["model", "average"]
    assert weight_sets({**state, "weight_sets": []}) == ["model"]
    assert weight_sets({**state, "weight_sets": ["average"]}) == ["model", "average"]
