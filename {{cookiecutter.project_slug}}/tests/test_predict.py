"""predict.py on the reference task: a folder of real image files, predicted from a
checkpoint and from each file export.py writes, on 1, 2 and 3 processes, gives one file,
the same to the bit, with the model's own answer for every image; bad input is one line
and leaves nothing behind."""

import json
import shutil

import pytest
import torch
from PIL import Image

from conftest import FAST, machinery_project, reference_config, reference_task, run_script

IMAGES = 11  # with eval_batch_size 4 on 3 processes: a short last batch, and ranks with 1 and 2 batches


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained checkpoint, and export.py's four files of it."""
    root = tmp_path_factory.mktemp("predict")
    run_script("train.py", [*FAST, "data.train_size=256", "train.epochs=1", f"output_dir={root / 'run'}"])
    checkpoint = root / "run" / "checkpoints" / "last.pt"
    run_script("export.py", ["--checkpoint", checkpoint, "--out", root / "export" / "model.pt", "--program"])
    return checkpoint, root / "export"


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """PNG files of validation images, some in a sub-folder, beside a file that is no image."""
    folder = tmp_path_factory.mktemp("photos")
    (folder / "more").mkdir()
    (folder / "notes.txt").write_text("not an image")
    val_set = reference_task().data.build_datasets(reference_config(None, FAST))[1]
    for index in range(IMAGES):
        image, _ = val_set[index]
        pixels = (image * 0.25 + 0.5).clamp(0, 1).mul(255).round().to(torch.uint8)  # undo Normalize(0.5, 0.25)
        where = folder / "more" if index % 4 == 0 else folder
        Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(where / f"image{index:02d}.png")
    return folder


def predict(source, photos, out, nproc=None, extra=(), check=True):
    args = ["--checkpoint", source, "--inputs", photos, "--out", out, *extra]
    return run_script("predict.py", args, nproc=nproc, check=check)


def test_one_file_to_the_bit_from_any_model_file_on_1_2_and_3_processes(exported, photos, tmp_path):
    checkpoint, export = exported
    runs = {
        "checkpoint, 1 process": (checkpoint, None, []),
        "model.pt, 2 processes": (export / "model.pt", 2, ["train.eval_batch_size=4"]),
        "model.safetensors, 3 processes": (export / "model.safetensors", 3, ["train.eval_batch_size=4"]),
        "model.pt2, 3 processes": (export / "model.pt2", 3, ["train.eval_batch_size=4"]),
        "model.pt2, 1 process": (export / "model.pt2", None, ["train.eval_batch_size=3"]),
    }
    written = {}
    for name, (source, nproc, extra) in runs.items():
        out = tmp_path / name.replace(" ", "_") / "predictions.jsonl"
        shown = predict(source, photos, out, nproc, extra).stdout
        assert f"wrote {out}: {IMAGES} predictions" in shown
        written[name] = out.read_bytes()
        assert sorted(p.name for p in out.parent.iterdir()) == ["predictions.jsonl"]  # no rank's share is left
    first = written["checkpoint, 1 process"]
    assert all(text == first for text in written.values()), [name for name, text in written.items() if text != first]

    rows = [json.loads(line) for line in first.decode().splitlines()]
    files = sorted(str(p) for p in photos.rglob("*.png"))
    assert [row["input"] for row in rows] == files  # every image once, in path order, and nothing else
    task, cfg = reference_task(), reference_config(export / "model.yaml")
    model = task.model.build_model(cfg).eval()
    model.load_state_dict(torch.load(export / "model.pt", weights_only=True))
    inputs = task.data.build_predict_set(cfg, str(photos))
    with torch.no_grad():
        labels = model(torch.stack([inputs[i][0] for i in range(len(inputs))])).argmax(dim=1).tolist()
    assert [row["label"] for row in rows] == labels


@pytest.mark.parametrize(
    "case", ["out exists", "no inputs folder", "no image in it", "program without its settings", "truncated program"]
)
def test_bad_input_is_one_line_and_writes_nothing(exported, photos, tmp_path, case):
    checkpoint, export = exported
    source, inputs, out = checkpoint, photos, tmp_path / "predictions.jsonl"
    if case == "out exists":
        out.write_text("last week's predictions\n")
    elif case == "no inputs folder":
        inputs = tmp_path / "missing"
    elif case == "no image in it":
        inputs = tmp_path / "empty"
        inputs.mkdir()
        (inputs / "notes.txt").write_text("not an image")
    else:
        source = tmp_path / "model.pt2"
        shutil.copy(export / "model.pt2", source)
        if case == "truncated program":
            shutil.copy(export / "model.yaml", tmp_path / "model.yaml")
            source.write_bytes(source.read_bytes()[:1000])
    before = sorted(tmp_path.rglob("*"))
    result = predict(source, inputs, out, nproc=2, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr  # 1: torchrun's code when a rank fails
    expected = {
        "out exists": "already exists; choose another --out",
        "no inputs folder": "is not a folder",
        "no image in it": "holds no image files",
        "program without its settings": "model.yaml' is missing: export.py writes it",
        "truncated program": "as a torch.export program",
    }[case]
    assert expected in errors[0] and "torch/export/" not in result.stderr  # torch's own log of the failure is quiet
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing removed
    if case == "out exists":
        assert out.read_text() == "last week's predictions\n"


def test_a_predict_step_that_breaks_its_promise_stops_every_rank_in_one_line(exported, photos, tmp_path):
    """One result for a whole batch, and a result JSON cannot write: one line each, on the
    rank that met it, and no file."""
    checkpoint, _ = exported
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project, ignore=shutil.ignore_patterns("__pycache__"))
    model_py = project / "model.py"
    returns = "    return [\n        {"
    assert model_py.read_text().count(returns) == 1
    for mistake, expected in [
        ("    return [{'labels': labels.tolist()}]\n", "predict_step returned 1 result(s) for a batch of 4 inputs"),
        ("    return [{'input': p, 'scores': scores} for p in paths]\n", "is not JSON"),
        ("    return [{'input': p, 'score': float('nan')} for p in paths]\n", "is not JSON (Out of range float"),
    ]:
        model_py.write_text(model_py.read_text().replace(returns, mistake + returns, 1))
        out = tmp_path / "predictions.jsonl"
        args = ["--checkpoint", checkpoint, "--inputs", photos, "--out", out, "train.eval_batch_size=4"]
        result = run_script("predict.py", args, nproc=2, check=False, cwd=project)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 1 and len(errors) == 1 and expected in errors[0], result.stderr
        assert not out.exists() and list(tmp_path.glob(".predictions*")) == []
        model_py.write_text(model_py.read_text().replace(mistake, "", 1))


def test_a_task_without_the_hooks_is_told_what_to_add(exported, photos, tmp_path):
    """A model.py without predict_step or model_inputs, a data.py without build_predict_set:
    predict.py and export.py --program say which function to add, and write nothing."""
    checkpoint, _ = exported
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project, ignore=shutil.ignore_patterns("__pycache__"))
    cases = [
        ("data.py", "def build_predict_set(", "predict.py", "data.py has no build_predict_set; add"),
        ("model.py", "def predict_step(", "predict.py", "model.py has no predict_step; add"),
        ("model.py", "def model_inputs(", "export.py", "--program: model.py has no model_inputs(batch); add one"),
    ]
    for file, definition, script, expected in cases:
        source = project / file
        original = source.read_text()
        source.write_text(original.replace(definition, "def unused_" + definition[4:], 1))
        out = tmp_path / "out" / ("predictions.jsonl" if script == "predict.py" else "model.pt")
        args = ["--inputs", photos] if script == "predict.py" else ["--program"]
        result = run_script(script, ["--checkpoint", checkpoint, "--out", out, *args], check=False, cwd=project)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and expected in errors[0], result.stderr
        assert not (tmp_path / "out").exists()
        source.write_text(original)


def test_processes_that_list_different_inputs_stop_in_one_line(exported, photos, tmp_path):
    """A folder that changes while the processes list it (or differs between nodes) would
    misalign the joined lines: the processes compare their counts first."""
    checkpoint, _ = exported
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project, ignore=shutil.ignore_patterns("__pycache__"))
    data_py = project / "data.py"
    patched = data_py.read_text().replace(
        '    if not files:\n        raise DataError(f"--inputs:',
        "    files = files[: len(files) - int(os.environ.get('RANK', '0'))]  # rank 1 misses one\n"
        '    if not files:\n        raise DataError(f"--inputs:',
        1,
    )
    assert patched != data_py.read_text()
    data_py.write_text(patched)
    out = tmp_path / "predictions.jsonl"
    args = ["--checkpoint", checkpoint, "--inputs", photos, "--out", out]
    result = run_script("predict.py", args, nproc=2, check=False, cwd=project)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and errors == [
        "error: --inputs: the processes found from 10 to 11 inputs; every process must see the same inputs "
        "(a folder still being written, or different on each node)"
    ], result.stderr
    assert not out.exists() and list(tmp_path.glob(".predictions*")) == []


def test_a_missing_model_file_and_an_out_named_like_its_companions_are_one_line(exported, photos, tmp_path):
    checkpoint, export = exported
    missing = predict(tmp_path / "nope" / "model.pt2", photos, tmp_path / "p.jsonl", check=False)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1] == (
        f"error: --checkpoint '{tmp_path / 'nope' / 'model.pt2'}' not found"
    )
    args = ["--checkpoint", checkpoint, "--out", tmp_path / "model.pt2", "--program"]
    clash = run_script("export.py", args, check=False)
    assert clash.returncode == 2 and "is named as a file written beside it" in clash.stderr.strip().splitlines()[-1]
    assert list(tmp_path.glob("model*")) == []
