"""torchrun, ending with the run's own last word instead of torchrun's summary.

  python -m engine.launch --standalone --nproc_per_node=4 train.py [section.key=value ...]

It takes exactly torchrun's options, and is torchrun (torch.distributed.run's own parser
and launch) but for how it ends:

- a process fails: one line on stderr, not torchrun's failure summary and traceback
  (about 38 lines): the process's own `error: ...` line, or for a crash its exception,
  for a process killed by a signal which one. The exit code is the process's (2 for bad
  input), 128 + the signal for a killed one; torchrun exits 1 for everything.
- SIGINT or SIGTERM (Ctrl-C, a scheduler's stop): torchrun passes it to every process
  and waits for them. When each saved a checkpoint, train.py's `stopped at step N ...`
  line is the last word and the exit code 75 (stopped: the same command continues), as
  train.py's own; otherwise one line instead of torchrun's SignalException traceback,
  exit code 128 + the signal (130, 143), as a shell reports. (`--signals-to-handle=...,SIGUSR1`
  adds SIGUSR1, as sweep.py does.)
- the processes stop by themselves (a signal sent to them alone): train.py's `stopped at
  step N ...` line, exit code 75, as train.py's own.

A process leaves its line where torchrun looks for a failure's message: the error file
torchrun names in TORCHELASTIC_ERROR_FILE (engine.logs.hand_to_launcher, in the format of
torch's `@record`), so plain torchrun's summary shows the line too.
"""

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from engine.lifecycle import STOPPED_EXIT_CODE
from engine.logs import ERROR_FILE_VARIABLE


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="torchelastic_")  # where each process leaves its last word
    # Under a launcher of its own, hand the failing process's error file on to it as torchrun does.
    launch = record(run) if ERROR_FILE_VARIABLE in os.environ else run
    try:
        launch(args)
    except ChildFailedError as failed:
        rank, failure = likely_cause(failed.failures)
        print(failure_line(rank, failure), file=sys.stderr, flush=True)
        return exit_code(failure)
    except (SignalException, KeyboardInterrupt) as stop:
        # torchrun has passed the signal on and waited for its processes: a further signal may end this one at once.
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop_signal, signal.SIG_DFL)
        sigval = getattr(stop, "sigval", signal.SIGINT)  # KeyboardInterrupt: before torchrun took the signals
        if isinstance(stop, SignalException) and not processes_left() and all_saved(Path(args.log_dir)):
            return STOPPED_EXIT_CODE  # each said so (train.py's `stopped at step N ...`): the same command continues
        print(stopped_line(sigval, started=isinstance(stop, SignalException)), file=sys.stderr, flush=True)
        return 128 + sigval
    return 0


def stopped_line(sigval: signal.Signals, started: bool) -> str:
    stopped = f"stopped by {sigval.name}"
    if not started:
        return f"{stopped} before any process started"
    if processes_left():  # torchrun gave up waiting (a signal while it waited): they stop on their own
        return f"{stopped}: torchrun passed it on to every process; some are still stopping on their own"
    return f"{stopped}: torchrun passed it on to every process, and all have ended (their last lines say how)"


def all_saved(log_dir: Path) -> bool:
    """Whether every process of torchrun's last attempt stopped with a checkpoint: each left
    STOPPED_EXIT_CODE in its error file (engine.logs.hand_to_launcher)."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda path: int(path.name.removeprefix("attempt_")))
    processes = [path / "error.json" for path in attempts[-1].iterdir()] if attempts else []
    codes = [json.loads(path.read_text())["message"].get("errorCode") if path.is_file() else None for path in processes]
    return bool(codes) and all(code == STOPPED_EXIT_CODE for code in codes)


def processes_left() -> bool:
    """Whether a process this one started is still running (those that ended are reaped)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return False
        if pid == 0:
            return True


def likely_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure that most likely caused the others. torchrun's 'first observed failure'
    compares whole seconds, and dates a failure without an error file when it noticed it:
    a process that stopped because another failed often looks first."""
    return min(failures.items(), key=lambda item: (blame_order(item[1]), item[1].timestamp, item[0]))


def blame_order(failure: ProcessFailure) -> int:
    """Lower first: an `error: ...` line of the process (bad input, out of memory: what it
    found wrong); a kill from outside (SIGKILL: out of memory); a crash (@record's
    traceback); any other line of the process (`rank N stopped: lost contact with another
    process`: a consequence); an exit code alone (a process that stopped because another
    did); SIGTERM (what torchrun sends the rest as soon as one exits)."""
    word = last_word(failure)
    if word is not None:
        return 0 if word[0].startswith("error: ") else 3
    if failure.exitcode == -signal.SIGTERM:
        return 5
    if failure.exitcode < 0:
        return 1
    return 2 if traceback_message(failure) is not None else 4


def last_word(failure: ProcessFailure) -> tuple[str, int] | None:
    """The line and exit code the process left in its error file (`hand_to_launcher`);
    None when it left none, or a traceback (@record)."""
    message = recorded(failure)
    if message is None or "errorCode" not in message:
        return None
    line = message.get("extraInfo", {}).get("py_callstack", "").strip()
    return (line, int(message["errorCode"])) if line and "\n" not in line else None


def traceback_message(failure: ProcessFailure) -> str | None:
    """The last line of the exception @record wrote for the process, if it did."""
    message = recorded(failure)
    if message is None or last_word(failure) is not None:
        return None
    # `Type: message`; a DataLoader worker's error carries the worker's traceback, its cause last.
    lines = str(message.get("message", "")).strip().splitlines() or ["an exception"]
    exception_type = lines[0].split(":")[0]
    return lines[-1] if lines[-1].startswith(exception_type) else f"{exception_type}: {lines[-1]}"


def recorded(failure: ProcessFailure) -> dict | None:
    """What the process wrote into its error file, in @record's layout."""
    if os.path.isfile(failure.error_file) and isinstance(failure.message, dict):
        return failure.message
    return None


def failure_line(rank: int, failure: ProcessFailure) -> str:
    word = last_word(failure)
    if word is not None:
        return word[0]
    exception = traceback_message(failure)
    if exception is not None:
        return f"error: rank {rank} failed: {exception} (traceback above and in {failure.error_file})"
    if failure.exitcode < 0:
        cause = " (the out-of-memory killer, or kill -9)" if failure.exitcode == -signal.SIGKILL else ""
        return f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}{cause}"
    return f"error: rank {rank} exited with code {failure.exitcode}; its output above may say why"


def exit_code(failure: ProcessFailure) -> int:
    """The code the process exited, or was about to exit, with; for a kill, 128 + the
    signal, as a shell reports it."""
    word = last_word(failure)
    if word is not None:
        return word[1]
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


if __name__ == "__main__":
    sys.exit(main())
