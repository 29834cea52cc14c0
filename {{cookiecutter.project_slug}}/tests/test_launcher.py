"""python -m engine.launch: torchrun, ending with the run's own line and exit code.

Two real launches (bad input, Ctrl-C); whether a stop saved and how the launcher picks the failure to show is
tested on error files written here, as torchrun's processes write them.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.multiprocessing import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from conftest import FAST, children, clean_env, finish, last_wins, machinery_project, wait_for_line
from engine.launch import all_saved, shown_failure
from engine.lifecycle import pid_alive
from engine.logs import write_last_word


def start_launcher(args: list, launcher_args=False) -> subprocess.Popen:
    """`python -m engine.launch` on 2 processes, stdout and stderr in one stream as on a terminal;
    `args` are train.py's, or the launcher's (`launcher_args`)."""
    ahead, after = (args, []) if launcher_args else ([], last_wins(args))
    return subprocess.Popen(
        [sys.executable, "-m", "engine.launch", "--standalone", "--nproc_per_node=2", *ahead, "train.py", *after],
        cwd=machinery_project(),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


@pytest.mark.slow  # a real launch: the slow tier (pytest -m slow)
def test_bad_input_on_two_processes_ends_with_the_projects_line_and_exit_code_2(tmp_path):
    process = start_launcher([*FAST, "optim.lr=-1", f"output_dir={tmp_path / 'run'}"])
    output = finish(process, [])
    assert process.returncode == 2, output
    assert output.splitlines()[-1] == "error: optim.lr must be > 0, got -1.0", output
    assert "Traceback" not in output and "FAILED" not in output, output


@pytest.mark.parametrize("kind", ["a file", "below a file", "a link to a file"])
def test_a_log_dir_that_cannot_be_a_folder_is_one_line_before_any_process_starts(tmp_path, kind):
    (tmp_path / "file").write_text("mine")
    log_dir = {
        "a file": tmp_path / "file",
        "below a file": tmp_path / "file" / "logs",
        "a link to a file": tmp_path / "link",
    }[kind]
    (tmp_path / "link").symlink_to(tmp_path / "file")
    process = start_launcher([f"--log-dir={log_dir}"], launcher_args=True)
    output = finish(process, [])
    assert process.returncode == 2 and output.count("\n") == 1, output
    assert output.startswith(f"error: --log-dir '{log_dir}': Not a directory; give a folder to write in"), output
    assert (tmp_path / "file").read_text() == "mine"


# Ctrl-C; a closed terminal or ssh session (SIGHUP); Ctrl-\\ (SIGQUIT). torchrun passes each on.
@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),  # real launches: the slow tier (pytest -m slow)
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
        pytest.param(signal.SIGQUIT, marks=pytest.mark.slow),
    ],
    ids=["ctrl-c", "sighup", "sigquit"],
)
def test_a_stop_signal_stops_every_process_with_a_checkpoint_then_the_projects_line_and_exit_code_75(tmp_path, stop):
    args = [*FAST, "data.train_size=8192", "train.log_every_steps=1", "train.stop_at_step=300"]
    process, seen = start_launcher([*args, f"output_dir={tmp_path / 'run'}"]), []
    wait_for_line(process, "step 3 ", seen)
    ranks = children(process.pid)
    assert len(ranks) == 2, seen
    process.send_signal(stop)  # to torchrun alone: its ranks have process groups of their own
    output = finish(process, seen)
    assert process.returncode == 75, output  # stopped: the same command continues
    assert "Traceback" not in output and "SignalException" not in output, output
    last = output.splitlines()[-1]  # rank 0's, as without a launcher
    assert last.startswith("stopped at step ") and last.endswith("run the same command to continue"), output
    assert f"by {stop.name}" in last and not (tmp_path / "run" / "run.lock").exists()
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    assert not [pid for pid in ranks if pid_alive(pid)]


def test_a_stop_counts_as_saved_only_when_every_process_of_the_last_attempt_said_so(tmp_path):
    def attempt(number: int, codes: list) -> None:
        for rank, code in enumerate(codes):
            (tmp_path / "run" / f"attempt_{number}" / str(rank)).mkdir(parents=True)
            if code is not None:
                write_last_word(str(tmp_path / "run" / f"attempt_{number}" / str(rank) / "error.json"), "w", code)

    assert not all_saved(tmp_path)  # no process started
    attempt(0, [75, 1])
    assert not all_saved(tmp_path)
    attempt(10, [75, 75])  # the last attempt, though it sorts before attempt_2 as text
    attempt(2, [75, None])
    assert all_saved(tmp_path)
    attempt(11, [75, None])  # one process left no line: it did not save
    assert not all_saved(tmp_path)
    assert all_saved(tmp_path / "elsewhere") is False  # a --log-dir that does not exist yet: nothing saved
    (tmp_path / "run" / "attempt_11" / "1" / "error.json").write_text('{"message": "not a dict"}')
    assert not all_saved(tmp_path)  # an error file it did not write


def test_a_stop_in_a_reused_log_dir_counts_only_this_launchs_processes(tmp_path):
    earlier_run = tmp_path / "earlier_x" / "attempt_0" / "0"
    earlier_run.mkdir(parents=True)
    write_last_word(str(earlier_run / "error.json"), "w", 75)
    earlier = set(tmp_path.iterdir())
    assert all_saved(tmp_path) and not all_saved(tmp_path, earlier)
    (tmp_path / "this_y" / "attempt_x").mkdir(parents=True)  # not an attempt torchrun makes
    assert not all_saved(tmp_path, earlier)


# -- which failure the launcher shows -----------------------------------------------------------


def failure(tmp_path, rank: int, exitcode: int, word=None, exception=None) -> ProcessFailure:
    """A process's failure as torchrun reads it: the error file its process left, if any
    (`word`: its one line and exit code; `exception`: @record's record of a crash)."""
    error_file = tmp_path / f"error_{rank}.json"
    if word is not None:
        line, code = word
        write_last_word(str(error_file), line, code)
    elif exception is not None:
        extra = {"py_callstack": f"Traceback ...\n{exception}", "timestamp": str(int(time.time()))}
        message = {"message": exception, "extraInfo": extra}
        error_file.write_text(json.dumps({"message": message}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


BAD_LR = ("error: optim.lr must be > 0, got -1.0", 2)
LOST = ("rank 0 stopped: lost contact with another process: it crashed, was killed, ...", 1)


def test_the_line_of_a_process_torchrun_ended_while_it_exited_keeps_its_exit_code(tmp_path):
    """torchrun sends SIGTERM to the rest as soon as one process exits: rank 0, slower to
    leave after saying why, may die of it; the quiet rank 1 exited first."""
    failures = {0: failure(tmp_path, 0, -signal.SIGTERM, word=BAD_LR), 1: failure(tmp_path, 1, 2)}
    assert shown_failure(failures) == BAD_LR


def test_a_killed_process_is_blamed_rather_than_the_ones_that_lost_contact_with_it(tmp_path):
    failures = {0: failure(tmp_path, 0, 1, word=LOST), 1: failure(tmp_path, 1, -signal.SIGKILL)}
    killed = "error: rank 1 (pid 1001) was killed by SIGKILL (the out-of-memory killer, or kill -9)"
    assert shown_failure(failures) == (killed, 137)


def test_a_process_torchrun_killed_long_after_another_ended_is_named_as_stuck(tmp_path):
    """A rank stuck (a hung stream, a collective): the other times out and exits; torchrun's
    SIGTERM goes unheeded and its SIGKILL follows 30 s later. No out-of-memory killer."""
    failures = {0: failure(tmp_path, 0, 1, word=LOST), 1: failure(tmp_path, 1, -signal.SIGKILL)}
    failures[0].timestamp -= 31  # rank 0 left its line 31 s before torchrun found rank 1 killed
    line, code = shown_failure(failures)
    assert line.startswith("error: rank 1 (pid 1001) was stuck: it did not stop on torchrun's SIGTERM") and code == 137
    assert "out-of-memory" not in line


def test_a_crash_is_blamed_rather_than_the_ones_that_lost_contact_with_it(tmp_path):
    crash = "RuntimeError: Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback\nRuntimeError: boom"
    failures = {0: failure(tmp_path, 0, 1, word=LOST), 1: failure(tmp_path, 1, 1, exception=crash)}
    line, code = shown_failure(failures)
    assert line.startswith("error: rank 1 failed: RuntimeError: boom (traceback above and in ") and code == 1


def test_torchruns_own_summary_shows_the_line_a_process_left(tmp_path):
    summary = str(ChildFailedError("train.py", {0: failure(tmp_path, 0, 2, word=BAD_LR)}))
    assert f"traceback : {BAD_LR[0]}\n" in summary
