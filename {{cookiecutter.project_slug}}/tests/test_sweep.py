"""sweep.py: a grid of settings, one ordinary run each, resumable, and a table of the
best metric of each."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import (
    FAST,
    clean_env,
    finish,
    load_checkpoint,
    machinery_project,
    run_script,
    start_script,
    wait_for_line,
)
from engine.lifecycle import pid_alive

pytestmark = pytest.mark.slow  # sweeps of real runs, stopped by signals: the slow tier (pytest -m slow)

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
    grid = sweep_module().parse_grid(["model.widths=[32,64],[64,128]", "optim.lr=0.1", "data.name='a,b',c"])
    assert grid == {"model.widths": ["[32,64]", "[64,128]"], "optim.lr": ["0.1"], "data.name": ["a,b", "c"]}


# -- run folder names ---------------------------------------------------------------------------


def sweep_module():
    sys.path.insert(0, str(machinery_project()))
    import sweep as module

    return module


def test_values_apart_keep_their_run_folders_apart_and_each_name_reads_back():
    """A value's `/`, `%`, `,` and `=` are percent-encoded in its run's folder name: `a/b`
    and `a_b` get folders of their own (one run would otherwise resume the other's), and a
    name splits back into its settings."""
    module = sweep_module()
    grid = module.parse_grid(["data.root=a/b,a_b,50%,/abs/path"])
    names = [output_dir.name for _, output_dir in module.plan(grid, Path("runs"))]
    assert names == ["data.root=a%2Fb", "data.root=a_b", "data.root=50%25", "data.root=%2Fabs%2Fpath"]
    assert [urllib.parse.unquote(name.split("=", 1)[1]) for name in names] == grid["data.root"]
    # Values holding the name's own separators: each name still splits back into its settings.
    grid = module.parse_grid(["data.name='a,model.x=b',c", "model.x=d,'b,model.x=d'"])
    for settings, output_dir in module.plan(grid, Path("runs")):
        pairs = [part.split("=") for part in output_dir.name.split(",")]
        assert {key: urllib.parse.unquote(value) for key, value in pairs} == settings


def test_a_quoted_value_is_named_and_passed_without_its_quotes():
    """Quotes keep a comma inside a value; train.py reads a command-line value as text, so
    it gets the text inside them, as the folder name shows it."""
    module = sweep_module()
    grid = module.parse_grid(["data.name='a,b',\"c,d\",e", "optim.lr=0.1"])
    assert grid == {"data.name": ["a,b", "c,d", "e"], "optim.lr": ["0.1"]}
    (settings, output_dir), *_ = module.plan(grid, Path("runs"))
    assert output_dir == Path("runs/data.name=a%2Cb")
    args = module.train_args(module.parse_args(["data.name=x"]), settings, output_dir)
    assert args == ["--config", "config.yaml", "data.name=a,b", "optim.lr=0.1", "output_dir=runs/data.name=a%2Cb"]


EMPTY = "has an empty value; give one between every two commas, e.g. optim.lr=0.05,0.1"
OUTPUT_DIR = "error: output_dir is each run's own folder under --out; set that folder with --out"


@pytest.mark.parametrize(
    "setting, line",
    [
        ("optim.lr=,", f"error: 'optim.lr=,' {EMPTY}"),
        ("optim.lr=0.1,", f"error: 'optim.lr=0.1,' {EMPTY}"),
        ("output_dir=a,b", OUTPUT_DIR),
        ("output_dir=a", OUTPUT_DIR),
    ],
)
def test_a_setting_sweep_cannot_run_is_one_line_before_anything_runs(tmp_path, setting, line):
    result = sweep(tmp_path / "sweep", setting, *FIXED, "train.stop_at_step=1")  # short, were it to run
    assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")
    assert not (tmp_path / "sweep").exists()


def test_a_run_folder_name_over_the_file_systems_limit_is_one_line_and_the_table_never_crashes(tmp_path):
    long_value = "1" * 300
    result = sweep(tmp_path / "sweep", "--list", f"model.hidden_dim=16,{long_value}")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == (
        f"error: run 1's folder name 'model.hidden_dim={long_value}' is 317 bytes, more than the 255 a name "
        f"may have on the file system of {tmp_path}; sweep shorter values\n"
    )
    shown = sweep_module().table([(tmp_path / ("x" * 300), None)])
    assert shown.splitlines()[1].split()[-2:] == ["not", "started"]


def test_two_runs_that_would_share_a_folder_are_refused_in_one_line(tmp_path):
    result = sweep(tmp_path / "sweep", "--list", "data.name='1',1")
    assert result.returncode == 2 and result.stderr == (
        f"error: runs 0 and 1 would share the folder {tmp_path / 'sweep' / 'data.name=1'}; "
        "give each value once (quotes are not part of a value)\n"
    )


# -- a stopped run, a stopped sweep --------------------------------------------------------------

STOPPED = 75  # EX_TEMPFAIL: stopped before its end with a checkpoint; run the same command to continue
# Epochs long enough that a signal lands mid-run; each run ends at train.stop_at_step.
LONG = [
    *(arg for arg in FAST if not arg.startswith(("optim.lr=", "data.train_size=", "train.log_every_steps="))),
    "data.train_size=8192",
    "train.log_every_steps=1",
    "train.stop_at_step=300",
]


def test_a_run_stopped_by_a_signal_exits_with_the_stopped_code(tmp_path):
    process, seen = start_script("train.py", [*LONG, f"output_dir={tmp_path}"]), []
    wait_for_line(process, "step 3 ", seen)
    process.send_signal(signal.SIGTERM)
    output = finish(process, seen)
    assert process.returncode == STOPPED, output
    assert "stopped at step" in output and load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] >= 3


def start_sweep(out: Path, nproc: int) -> subprocess.Popen:
    """sweep.py over 2 runs, started as a shell starts a command: in a process group of its
    own, which a terminal's Ctrl-C signals whole."""
    return subprocess.Popen(
        [sys.executable, "sweep.py", "--out", str(out), "--nproc", str(nproc), *LONG, "optim.lr=0.05,0.1"],
        cwd=machinery_project(),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )


def processes_naming(path: Path) -> list[int]:
    """The processes whose command line names `path`: a sweep, its runs and their ranks."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


def end_of_sweep(process: subprocess.Popen, seen: list, run: list[int]) -> tuple[str, list[int]]:
    """The sweep's whole output once its pipe has closed, and the processes of `run` still
    running 10 s later (a process may close its output a moment before it exits): killed,
    so a failing test leaves none."""
    try:
        output = finish(process, seen, timeout=90)
    except subprocess.TimeoutExpired:
        output = "".join(seen) + "\n(still running 90 s after the signal)"
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in run) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in run if pid_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return output, left


LAUNCHER = (machinery_project() / "engine" / "launch.py").exists()  # else plain torchrun, with its traceback


@pytest.mark.parametrize(
    "nproc, stop",
    [(1, "Ctrl-C"), (1, signal.SIGTERM), (2, "Ctrl-C"), (2, signal.SIGUSR1), (2, signal.SIGKILL)],
    ids=["ctrl-c", "sigterm", "nproc2-ctrl-c", "nproc2-sigusr1", "nproc2-sigkill"],
)
def test_a_stopped_sweep_stops_its_run_with_a_checkpoint_starts_no_other_and_leaves_no_process(tmp_path, nproc, stop):
    out = tmp_path / "sweep"
    process, seen = start_sweep(out, nproc), []
    wait_for_line(process, "step 3 ", seen)
    run = [pid for pid in processes_naming(out) if pid != process.pid]
    assert len(run) >= nproc, seen  # train.py, or the launcher and its ranks
    if stop == "Ctrl-C":
        os.killpg(process.pid, signal.SIGINT)  # what a terminal sends the command's process group
    else:
        os.kill(process.pid, stop)
    output, left = end_of_sweep(process, seen, run)
    assert not left, f"{len(left)} processes of the run still there after the sweep's end\n{output}"
    stopped = out / "optim.lr=0.05"
    assert "stopped at step" in output and load_checkpoint(stopped / "checkpoints" / "last.pt")["step"] >= 3, output
    assert not (out / "optim.lr=0.1").exists(), output  # the next run never started
    if stop == signal.SIGKILL:  # the kernel's SIGTERM to the launcher; nothing is left to say more
        assert "stopped at step" in output and "by SIGTERM" in output, output
        return
    assert process.returncode == STOPPED, output
    assert "Traceback" not in output or (nproc > 1 and not LAUNCHER), output
    by = "SIGINT" if stop == "Ctrl-C" else stop.name
    said = f"sweep: run 1 of 2 stopped by {by}; run the same command to continue\n"
    assert f"by {by}; checkpoint saved" in output and said in output, output
    assert output.index("stopped at step") < output.index(said), output  # the sweep waited for the checkpoint
    table = [row.split() for row in output.strip().splitlines()[-2:]]
    assert table == [
        ["optim.lr=0.05", *table[0][1:-1], "stopped"],
        ["optim.lr=0.1", "-", "-", "not", "started"],
    ], output


# A child that notes the stop signals it gets, and exits 75 at the second.
NOTES_SIGNALS = """
import signal, sys, time
got = []
def note(signum, frame):
    got.append(signal.Signals(signum).name)
    print("got", *got, flush=True)
    if len(got) == 2:
        sys.exit(75)
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, note)
print("ready", flush=True)
time.sleep(120)
"""
SUPERVISES = """
import sys
from engine.supervisor import Supervisor
with Supervisor() as supervisor:
    print("ended:", supervisor.run([sys.executable, "-c", sys.argv[1]]), supervisor.stop_signal, flush=True)
"""


def test_the_supervisor_passes_on_the_first_stop_signal_then_only_a_second_ctrl_c():
    """What a sweep's run gets: Ctrl-C, then SIGTERM (not passed on: the run is stopping
    already), then Ctrl-C again (passed on: train.py's "stop now")."""
    supervisor, seen = start_script("-c", [SUPERVISES, NOTES_SIGNALS]), []
    wait_for_line(supervisor, "ready", seen)
    supervisor.send_signal(signal.SIGINT)
    wait_for_line(supervisor, "got SIGINT", seen)
    supervisor.send_signal(signal.SIGTERM)
    supervisor.send_signal(signal.SIGINT)
    output = finish(supervisor, seen)
    assert output.splitlines()[-2:] == ["got SIGINT SIGINT", "ended: stopped SIGINT"], output
    assert supervisor.returncode == 0, output
