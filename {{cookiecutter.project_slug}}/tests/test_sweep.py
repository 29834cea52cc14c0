"""sweep.py: a grid of settings, one ordinary run each, resumable, and a table of the
best metric of each."""

import subprocess
import sys

from conftest import FAST, clean_env, load_checkpoint, machinery_project, run_script

GRID = ["optim.lr=0.05,0.1", "model.hidden_dim=16,32"]
# FAST's settings, but those the grid sweeps, with smaller data (a key is given once to sweep.py).
FIXED = [
    f"{k}={v}" for k, v in (dict(a.split("=", 1) for a in [*FAST, "data.train_size=128", "train.epochs=2"])).items()
]
FIXED = [arg for arg in FIXED if arg.split("=")[0] not in {setting.split("=")[0] for setting in GRID}]


def sweep(out, *settings) -> subprocess.CompletedProcess:
    project = machinery_project()
    command = [sys.executable, "sweep.py", "--out", str(out), *settings]
    return subprocess.run(command, cwd=project, env=clean_env(), capture_output=True, text=True, timeout=600)


RUN_NAMES = [f"optim.lr={lr},model.hidden_dim={width}" for lr in ("0.05", "0.1") for width in ("16", "32")]


def test_a_2x2_grid_finishes_four_runs_resumes_one_stopped_midway_and_ends_with_their_table(tmp_path):
    out = tmp_path / "sweep"
    names = RUN_NAMES
    stopped = [*FIXED, "optim.lr=0.1", "model.hidden_dim=16", f"output_dir={out / names[2]}", "train.stop_at_step=3"]
    assert "stopped at step 3" in run_script("train.py", stopped).stdout  # as a sweep stopped midway leaves it

    finished = sweep(out, *GRID, *FIXED)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (
        finished.stdout.count("resumed from") == 1
        and f"{names[2]}/checkpoints/last.pt: epoch 0, step 3" in finished.stdout
    )
    table = finished.stdout.strip().splitlines()[-5:]
    assert table[0].split() == ["run", "best", "at", "step", "ended"]
    assert [row.split()[0] for row in table[1:]] == names
    for row in table[1:]:  # the task's checkpoint.best_metric, each run's own best, all ended well
        _, metric, value, step, ended = row.split()
        assert metric == "val_acc" and 0 < float(value) <= 1 and step in ("8", "16") and ended == "ok"
    assert load_checkpoint(out / names[2] / "checkpoints" / "last.pt")["step"] == 16

    shown = sweep(out, "--table", "optim.lr=0.05,0.1,0.2", *GRID[1:], *FIXED)  # a larger grid: runs nothing
    rows = [row.split() for row in shown.stdout.strip().splitlines()[1:]]
    assert [row[:-1] for row in rows[:4]] == [row.split()[:-1] for row in table[1:]]  # as the sweep left them
    assert [row[-1] for row in rows[:4]] == ["-"] * 4 and [row[-2:] for row in rows[4:]] == [["not", "started"]] * 2


def test_each_run_of_a_grid_by_its_number_for_a_slurm_job_array(tmp_path):
    listed = sweep(tmp_path, "--list", *GRID, "train.epochs=3").stdout.splitlines()
    assert listed == [f"{k}  {tmp_path}/{name}" for k, name in enumerate(RUN_NAMES)]
    for number, name in enumerate(RUN_NAMES):
        shown = sweep(tmp_path, "--print-run", str(number), *GRID, "train.epochs=3")
        lr, width = (part.split("=")[1] for part in name.split(","))
        expected = ["--config", "config.yaml", f"optim.lr={lr}", f"model.hidden_dim={width}", "train.epochs=3"]
        assert shown.stdout.splitlines() == [*expected, f"output_dir={tmp_path}/{name}"]
    beyond = sweep(tmp_path, "--print-run", "4", *GRID)
    assert beyond.returncode == 2 and beyond.stderr == "error: no run 4: the grid has runs 0 to 3\n"


def test_a_setting_without_values_is_one_line(tmp_path):
    result = sweep(tmp_path, "optim.lr=")
    assert result.returncode == 2
    assert result.stderr == "error: 'optim.lr=' is not of the form section.key=value1,value2\n"


def test_values_split_at_commas_outside_brackets():
    sys.path.insert(0, str(machinery_project()))
    from sweep import parse_grid

    grid = parse_grid(["model.widths=[32,64],[64,128]", "optim.lr=0.1", "data.name='a,b',c"])
    assert grid == {"model.widths": ["[32,64]", "[64,128]"], "optim.lr": ["0.1"], "data.name": ["'a,b'", "c"]}
