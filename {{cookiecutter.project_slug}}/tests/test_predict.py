"""predict.py on the reference task: a folder of real image files, predicted from a
checkpoint and from each file of weights export.py writes, on 1, 2 and 3 processes, gives one file,
the same to the bit, with the model's own answer for every image; bad input is one line
and leaves nothing behind."""

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
import zipfile

import pytest
import safetensors.torch
import torch
from PIL import Image

from conftest import FAST, clean_env, command, machinery_project, reference_config, reference_task, run_script

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
        "model.safetensors, 1 process": (export / "model.safetensors", None, ["train.eval_batch_size=3"]),
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


@pytest.mark.parametrize("case", ["out exists", "no inputs folder", "no image in it", "weights without their settings"])
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
        source = tmp_path / "model.safetensors"
        shutil.copy(export / "model.safetensors", source)
    before = sorted(tmp_path.rglob("*"))
    result = predict(source, inputs, out, nproc=2, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr  # 1: torchrun's code when a rank fails
    expected = {
        "out exists": "already exists; choose another --out",
        "no inputs folder": "is not a folder",
        "no image in it": "holds no image files",
        "weights without their settings": "model.yaml' is missing: export.py writes it",
    }[case]
    assert expected in errors[0]
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
    missing = predict(tmp_path / "nope" / "model.safetensors", photos, tmp_path / "p.jsonl", check=False)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1] == (
        f"error: --checkpoint '{tmp_path / 'nope' / 'model.safetensors'}' not found"
    )
    args = ["--checkpoint", checkpoint, "--out", tmp_path / "model.pt2", "--program"]
    clash = run_script("export.py", args, check=False)
    assert clash.returncode == 2 and "is named as a file written beside it" in clash.stderr.strip().splitlines()[-1]
    assert list(tmp_path.glob("model*")) == []


class RunsCode:
    """Unpickling it writes `marker`: what a hostile file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def rewrite_archive(source, target, change) -> None:
    """Copy the zip archive `source` to `target`, `change` editing its members (names
    without the archive's root folder) in place."""
    with zipfile.ZipFile(source) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    root = next(iter(members)).split("/")[0]
    inside = {name.removeprefix(f"{root}/"): data for name, data in members.items()}
    change(inside)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in inside.items():
            archive.writestr(f"{root}/{name}", data)


def test_a_program_is_refused_unread_and_nothing_in_it_runs(exported, photos, tmp_path):
    """export.py's model.pt2, rewritten as a hostile file would be (a weight stored as a
    pickle that writes a file when unpickled): predict.py refuses any program before
    reading it, pointing at the weights beside it; export's own program the same way."""
    _, export = exported
    marker = tmp_path / "ran"

    def pickled_weight(members):
        config = json.loads(members["data/weights/model_weights_config.json"])
        config["config"]["net.2.linear.weight"]["use_pickle"] = True
        members["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        members["data/weights/weight_0"] = pickle.dumps(RunsCode(marker))

    hostile = tmp_path / "hostile" / "model.pt2"
    hostile.parent.mkdir()
    rewrite_archive(export / "model.pt2", hostile, pickled_weight)
    shutil.copy(export / "model.yaml", hostile.with_suffix(".yaml"))
    for program in (hostile, export / "model.pt2"):
        result = predict(program, photos, tmp_path / "p.jsonl", check=False)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"error: --checkpoint {str(program)!r} is a torch.export program, which predict.py does not load "
            "(loading one runs code made from the file); give model.safetensors, its weights, which export.py "
            "writes beside it"
        ], result.stdout + result.stderr
    assert not marker.exists() and not (tmp_path / "p.jsonl").exists()
    # What the refusal protects against: torch's own loader runs the hostile file's pickle.
    with contextlib.suppress(Exception):
        torch.export.load(hostile)
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_safetensors_of_another_kind_of_number_are_refused_by_name(exported, photos, tmp_path, dtype):
    _, export = exported
    weights = safetensors.torch.load_file(export / "model.safetensors")
    source = tmp_path / "model.safetensors"
    safetensors.torch.save_file({name: tensor.to(dtype) for name, tensor in weights.items()}, source)
    shutil.copy(export / "model.yaml", tmp_path / "model.yaml")
    result = predict(source, photos, tmp_path / "p.jsonl", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert f"'net.2.linear.weight' holds {dtype} in the checkpoint but torch.float32 in the model" in errors[0]
    assert not (tmp_path / "p.jsonl").exists()


@pytest.mark.slow  # the slow tier (pytest -m slow)
def test_two_runs_writing_the_same_out_leave_one_models_file_and_one_line(exported, photos, tmp_path):
    """Two predict.py runs from two checkpoints, both past the check that --out is free
    (each waits in build_predict_set until the other is there too): one writes the file,
    exactly as it alone would, the other stops in one line; no part of either is left."""
    first, _ = exported
    run_script("train.py", [*FAST, "data.train_size=256", "train.epochs=1", "seed=1", f"output_dir={tmp_path / 'b'}"])
    checkpoints = [first, tmp_path / "b" / "checkpoints" / "last.pt"]
    alone = []
    for index, checkpoint in enumerate(checkpoints):
        predict(checkpoint, photos, tmp_path / f"alone{index}.jsonl")
        alone.append((tmp_path / f"alone{index}.jsonl").read_bytes())
    assert alone[0] != alone[1]
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project, ignore=shutil.ignore_patterns("__pycache__"))
    data_py = project / "data.py"
    listing = "    folder = Path(source)\n"
    assert data_py.read_text().count(listing) == 1
    data_py.write_text(
        data_py.read_text().replace(
            listing,
            "    import time  # both runs are here, past predict.py's check that --out is free\n"
            "    (Path(os.environ['BARRIER']) / str(os.getpid())).touch()\n"
            "    while len(os.listdir(os.environ['BARRIER'])) < 2:\n"
            "        time.sleep(0.05)\n" + listing,
        )
    )
    (tmp_path / "barrier").mkdir()
    out = tmp_path / "shared" / "predictions.jsonl"
    runs = [
        subprocess.Popen(
            command("predict.py", ["--checkpoint", checkpoint, "--inputs", photos, "--out", out]),
            cwd=project,
            env=clean_env({"BARRIER": str(tmp_path / "barrier")}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for checkpoint in checkpoints
    ]
    results = [(run.wait(timeout=240), *run.communicate()) for run in runs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    winner = next(index for index, (code, _, _) in enumerate(results) if code == 0)
    assert out.read_bytes() == alone[winner]
    loser_errors = [line for line in results[1 - winner][2].splitlines() if line.startswith("error:")]
    assert loser_errors == [f"error: {str(out)!r} already exists; choose another --out or remove it first"]
    assert os.listdir(out.parent) == ["predictions.jsonl"]


def test_links_planted_where_predict_and_export_write_are_never_followed(exported, photos, tmp_path):
    """Links at the names the part files and temporary files once had, and at --out itself
    (pointing nowhere yet): their targets are never written, and a link at --out is a
    file that already exists."""
    checkpoint, _ = exported
    victims = tmp_path / "victims"
    victims.mkdir()
    out = tmp_path / "predictions.jsonl"
    planted = [f".{out.name}.rank0.tmp", f".{out.name}.rank1.tmp", f".{out.name}.tmp"]
    for name in planted:
        (victims / name).write_text("precious\n")
        (tmp_path / name).symlink_to(victims / name)
    predict(checkpoint, photos, out, nproc=2)
    assert all((victims / name).read_text() == "precious\n" for name in planted)
    assert all((tmp_path / name).is_symlink() for name in planted)
    assert len(out.read_text().splitlines()) == IMAGES

    for script, link, args in [
        ("predict.py", tmp_path / "p.jsonl", ["--out", tmp_path / "p.jsonl", "--inputs", photos]),
        ("export.py", tmp_path / "model.safetensors", ["--out", tmp_path / "model.pt"]),
    ]:
        victim = victims / f"new-{link.name}"
        link.symlink_to(victim)
        result = run_script(script, ["--checkpoint", checkpoint, *args], check=False)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and errors == [
            f"error: {str(link)!r} already exists; choose another --out or remove it first"
        ], result.stderr
        assert link.is_symlink() and not victim.exists()
    assert not (tmp_path / "model.pt").exists()


def test_images_under_a_linked_folder_are_predicted_and_a_link_loop_is_listed_once(exported, tmp_path):
    """Training follows links to folders (torchvision's ImageFolder does); so does the
    listing of the images to predict. A link back up the tree adds nothing."""
    checkpoint, _ = exported
    elsewhere, photos = tmp_path / "elsewhere", tmp_path / "photos"
    elsewhere.mkdir()
    photos.mkdir()
    for folder, count in ((photos, 2), (elsewhere, 3)):
        for index in range(count):
            Image.new("RGB", (8, 8), (index * 60, 0, 0)).save(folder / f"image{index}.png")
    (photos / "linked").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(photos, target_is_directory=True)
    out = tmp_path / "p.jsonl"
    predict(checkpoint, photos, out)
    inputs = [json.loads(line)["input"] for line in out.read_text().splitlines()]
    expected = [photos / "image0.png", photos / "image1.png"] + [photos / "linked" / f"image{i}.png" for i in range(3)]
    assert inputs == sorted(str(path) for path in expected)


@pytest.mark.slow  # a stop signal to real processes: the slow tier (pytest -m slow)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_a_stop_while_predicting_leaves_no_file_and_no_part(exported, photos, tmp_path, stop):
    """Ctrl-C or SIGTERM while the rank writes its part: the run stops, and its hidden
    folder of parts is gone with it."""
    checkpoint, _ = exported
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project, ignore=shutil.ignore_patterns("__pycache__"))
    model_py = project / "model.py"
    returns = "    return [\n        {"
    assert model_py.read_text().count(returns) == 1
    waits = (
        "    __import__('pathlib').Path(__import__('os').environ['STARTED']).touch()\n"
        "    __import__('time').sleep(600)\n"
    )
    model_py.write_text(model_py.read_text().replace(returns, waits + returns, 1))
    out, started = tmp_path / "out" / "predictions.jsonl", tmp_path / "started"
    run = subprocess.Popen(
        command("predict.py", ["--checkpoint", checkpoint, "--inputs", photos, "--out", out]),
        cwd=project,
        env=clean_env({"STARTED": str(started)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal, whatever started these tests: a runner in the background ignores
        # SIGINT, and a process that inherits that never sees a Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    while not started.exists():  # then predict_step runs, its rank's part open
        assert run.poll() is None, run.communicate()
        time.sleep(0.1)
    assert [path.name.startswith(".predictions.jsonl.") for path in out.parent.iterdir()] == [True]
    run.send_signal(stop)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr
    assert (
        stderr.splitlines()[-1]
        == "error: stopped by a signal before the end; nothing was written, run the same command again"
    )
    assert list(out.parent.iterdir()) == [], stderr
