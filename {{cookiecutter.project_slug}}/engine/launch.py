"""torchrun ending with the run's own last word and exit code: a failure, the failing process's line and code;
a stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT), 75 when every process saved, else 128 + the signal.
Takes torchrun's options:
python -m engine.launch --standalone --nproc_per_node=4 train.py [section.key=value ...]"""

import errno
import json
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from engine.lifecycle import STOP_SIGNALS, STOPPED_EXIT_CODE
from engine.logs import ERROR_FILE_VARIABLE

# torchrun sends SIGKILL 30 s after SIGTERM to the processes left once one ended; a process killed
# that long after another ended did not heed the SIGTERM. An outside kill comes first, the rest follow.
STUCK_AFTER_S = 15


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # where each process leaves its last word
        args.log_dir = usable_log_dir(args.log_dir) if args.log_dir else tempfile.mkdtemp(prefix="torchelastic_")
    except OSError as error:
        print(f"error: --log-dir {args.log_dir!r}: {error.strerror}; give a folder to write in", file=sys.stderr)
        return 2
    earlier = set(Path(args.log_dir).glob("*"))  # other launches' logs, in a --log-dir used before
    launch = record(run) if ERROR_FILE_VARIABLE in os.environ else run  # an outer launcher gets the error file
    try:
        launch(args)
    except ChildFailedError as failed:
        line, code = shown_failure(failed.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    except (SignalException, KeyboardInterrupt) as stop:
        for stop_signal in STOP_SIGNALS:  # torchrun has waited: a further signal ends this one
            signal.signal(stop_signal, signal.SIG_DFL)
        sigval = getattr(stop, "sigval", signal.SIGINT)  # KeyboardInterrupt: before torchrun took the signals
        passed = f"stopped by {sigval.name}: torchrun passed it on to every process"
        if not isinstance(stop, SignalException):
            line = f"stopped by {sigval.name} before any process started"
        elif processes_left():  # torchrun gave up waiting (a signal while it waited): they stop on their own
            line = f"{passed}; some are still stopping on their own"
        elif all_saved(Path(args.log_dir), earlier):
            return STOPPED_EXIT_CODE  # each said so (train.py's `stopped at step N ...`): the same command continues
        else:
            line = f"{passed}, and all have ended (their last lines say how)"
        print(line, file=sys.stderr, flush=True)
        return 128 + sigval
    return 0


def usable_log_dir(path: str) -> str:
    """`path`, made if missing, once a folder could be made in it (as torchrun makes one per launch)."""
    if os.path.lexists(path) and not os.path.isdir(path):  # a file, or a link to one: makedirs says "exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    os.makedirs(path, exist_ok=True)
    os.rmdir(tempfile.mkdtemp(prefix=".probe_", dir=path))
    return path


def all_saved(log_dir: Path, earlier: set = frozenset()) -> bool:
    """Whether every process of this launch's last attempt left STOPPED_EXIT_CODE in its error file."""
    attempts = [path for path in log_dir.glob("*/attempt_*") if path.parent not in earlier]
    attempts = [path for path in attempts if path.name.removeprefix("attempt_").isdigit()]
    attempts.sort(key=lambda path: int(path.name.removeprefix("attempt_")))
    codes = [saved_code(path / "error.json") for path in attempts[-1].iterdir()] if attempts else []
    return bool(codes) and all(code == STOPPED_EXIT_CODE for code in codes)


def saved_code(error_file: Path) -> int | None:
    """The exit code a process left in its error file; None for none, or one it did not write."""
    try:
        return json.loads(error_file.read_text())["message"]["errorCode"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def processes_left() -> bool:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return False
        if pid == 0:
            return True


def shown_failure(failures: dict[int, ProcessFailure]) -> tuple[str, int]:
    """The failure that most likely caused the others: torchrun's 'first observed' is often a consequence."""
    exits = [failure.timestamp for failure in failures.values() if failure.exitcode > 0]
    first_exit = min(exits, default=math.inf)
    return min(diagnosis(rank, failure, first_exit) for rank, failure in failures.items())[-2:]


def diagnosis(rank: int, failure: ProcessFailure, first_exit: float) -> tuple[int, float, int, str, int]:
    """(blame, timestamp, rank, line, exit code); blamed first: an `error: ...` line, a kill, a crash, another
    line (a consequence), an exit code alone, SIGTERM (torchrun's to the rest)."""
    recorded = os.path.isfile(failure.error_file) and isinstance(failure.message, dict)
    message = failure.message if recorded else None
    word = message.get("extraInfo", {}).get("py_callstack", "").strip() if message and "errorCode" in message else ""
    if word and "\n" not in word:  # hand_to_launcher's one line, and the exit code it was about to exit with
        return (0 if word.startswith("error: ") else 3), failure.timestamp, rank, word, int(message["errorCode"])
    code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # a kill: 128 + the signal
    blame = 5 if failure.exitcode == -signal.SIGTERM else 1 if failure.exitcode < 0 else 2 if message is not None else 4
    if message is not None:  # @record's `Type: message`; a DataLoader worker's error carries its cause last
        lines = str(message.get("message", "")).strip().splitlines() or ["an exception"]
        kind = lines[0].split(":")[0]
        exception = lines[-1] if lines[-1].startswith(kind) else f"{kind}: {lines[-1]}"
        line = f"error: rank {rank} failed: {exception} (traceback above and in {failure.error_file})"
    elif failure.exitcode == -signal.SIGKILL and failure.timestamp - first_exit >= STUCK_AFTER_S:
        line = (  # killed well after another process exited: torchrun's SIGKILL, its SIGTERM not heeded
            f"error: rank {rank} (pid {failure.pid}) was stuck: it did not stop on torchrun's SIGTERM after another "
            "process ended, and was killed (a hang in a collective, a DataLoader or the task's code; see its output)"
        )
    elif failure.exitcode < 0:
        cause = " (the out-of-memory killer, or kill -9)" if failure.exitcode == -signal.SIGKILL else ""
        line = f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}{cause}"
    else:
        line = f"error: rank {rank} exited with code {failure.exitcode}; its output above may say why"
    return blame, failure.timestamp, rank, line, code


if __name__ == "__main__":
    sys.exit(main())
