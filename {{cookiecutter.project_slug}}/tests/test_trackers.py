"""W&B (offline) and MLflow (a local sqlite store) with the real packages and real runs:
what they record, and that a resumed run goes on in the same tracker run."""

import json

import pytest
import torch

from conftest import FAST, has, read_metrics, run_script

wandb = pytest.importorskip("wandb", reason='needs pip install -e ".[wandb]"')
pytest.importorskip("sqlalchemy", reason='needs pip install -e ".[mlflow]"')
mlflow_tracking = pytest.importorskip("mlflow.tracking", reason='needs pip install -e ".[mlflow]"')

STEPS_PER_EPOCH = 256 // (16 * 2)
ARGS = [
    *FAST,
    "data.train_size=256",
    "train.epochs=3",
    "tracking.wandb=true",
    "tracking.mlflow=true",
    "tracking.project=trackers-test",
]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-process run stopped mid-epoch and resumed, and a run continuing its checkpoint
    in another output_dir, both tracked offline/locally."""
    root = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"}
    first, second = root / "first", root / "second"
    run_script("train.py", [*ARGS, f"output_dir={first}", f"train.stop_at_step={STEPS_PER_EPOCH + 4}"], 2, env)
    run_script("train.py", [*ARGS, f"output_dir={first}"], nproc=2, env=env)
    moved = [*ARGS, f"output_dir={second}", "train.epochs=4", f"checkpoint.resume={first}/checkpoints/last.pt"]
    run_script("train.py", moved, env=env)
    return root, first, second


def saved_runs(output_dir) -> dict:
    ckpt = torch.load(output_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return ckpt["states"]["tracking"]["runs"]


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_mlflow_records_config_curves_and_memory_in_one_run_across_a_resume(tracked):
    root, first, second = tracked
    client = mlflow_tracking.MlflowClient(f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("trackers-test")
    runs = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["first", "second"]  # the resume went on in "first"; a new output_dir started one
    run = runs["first"]
    assert saved_runs(first)["mlflow"] == run.info.run_id != saved_runs(second)["mlflow"]
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.1" and run.data.params["tracking.mlflow"] == "True"

    rows = read_metrics(first)
    val_loss = client.get_metric_history(run.info.run_id, "val/loss")
    assert [(m.step, m.value) for m in val_loss] == [(row["step"], row["val_loss"]) for row in rows]
    train_loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in train_loss) == list(range(4, 3 * STEPS_PER_EPOCH + 1, 4))  # both runs' steps
    if has("engine/parts/memory.py"):  # the memory_report part's table, per epoch
        memory = client.download_artifacts(run.info.run_id, f"memory/step_{STEPS_PER_EPOCH:08d}.json", str(root))
        table = json.loads(open(memory).read())
        assert len(table["rows"]) == 2 and table["rows"] == rows[0]["memory"]  # one row per rank


def test_wandb_records_config_and_curves_in_one_run_across_a_resume(tracked):
    _, first, second = tracked
    run_id = saved_runs(first)["wandb"]
    files = sorted((first / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # the stopped run and its resume: one id
    assert saved_runs(second)["wandb"] != run_id
    history, config = [], {}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "run":  # the config, as the run starts
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert config["optim.lr"] == 0.1 and config["tracking.wandb"] is True
    logged = {}
    for row in history:
        for key, value in row.items():
            logged.setdefault(key, {})[row.get("step")] = value
    assert sorted(logged["train/loss"]) == list(range(4, 3 * STEPS_PER_EPOCH + 1, 4))
    assert logged["val/loss"] == {row["step"]: row["val_loss"] for row in read_metrics(first)}
    if has("engine/parts/memory.py"):  # the memory_report part's table, per epoch
        epoch_ends = [row["step"] for row in read_metrics(first)]
        assert logged["memory/_type"] == dict.fromkeys(epoch_ends, "table-file")
        assert logged["memory/nrows"] == dict.fromkeys(epoch_ends, 2)  # a row per rank


def test_a_missing_tracker_package_is_one_line_before_training(tmp_path):
    hidden = tmp_path / "hidden" / "wandb"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    args = [*FAST, "tracking.wandb=true", f"output_dir={tmp_path / 'run'}"]
    result = run_script("train.py", args, env={"PYTHONPATH": str(hidden.parent)}, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: tracking.wandb is on but wandb cannot be imported (hidden by the test); install it with "
        'pip install -e ".[wandb]" or set tracking.wandb=false'
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tracker_that_cannot_start_is_one_line_before_training(tmp_path):
    args = [*FAST, "tracking.mlflow=true", f"output_dir={tmp_path / 'run'}"]
    (tmp_path / "a_file").write_text("")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/a_file/mlflow.db"}  # a folder that cannot exist
    result = run_script("train.py", args, env=env, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tracking.mlflow is on but its run cannot start (")
    assert lines[0].endswith("); fix its settings or set tracking.mlflow=false")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def wandb_records(path):
    """The records of an offline W&B run file: a 7-byte header, then LevelDB log blocks of
    32 KiB, each record in chunks (checksum, length, type: 1 whole, 2-4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if room < 7 or kind == 0:  # the rest of a block is padding
            pos += room
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record
