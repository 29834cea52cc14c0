"""Starts the tests' runs without a launcher, in seconds less each: torch is imported once
here, and every rank is forked from this process, then becomes `python SCRIPT ARGS` with
its own environment (torchrun's variables for its rank), working directory and output.

The ranks are real processes on real gloo process groups, with real files; only the
launcher is left out, so tests of the launcher itself (torchrun's restarts, signals,
srun) keep starting torchrun. conftest.py's `run_script` starts one server per test
process and sends it one request at a time, a JSON line:
  {"id", "script", "args", "cwd", "envs": [one environment per rank], "stdout", "stderr", "timeout"}
and reads back {"id", "returncodes": [...], "timed_out": bool}.

Like torchrun, once a rank fails the others get SIGTERM, and SIGKILL 30 s later.
"""

import atexit
import contextlib
import gc
import json
import os
import runpy
import signal
import sys
import threading
import time

# What every run imports anyway: each fork starts with them in memory. Nothing of the
# project is imported here, so each run imports its own files from its own folder.
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torchvision  # noqa: F401
import tqdm  # noqa: F401
import yaml  # noqa: F401

GRACE_S = 30  # torchrun's wait between SIGTERM and SIGKILL


def become_rank(request: dict, env: dict) -> None:
    """In the forked child: run the script as `python` would; never returns."""
    code = 1
    try:
        os.setsid()  # torchrun starts each rank in a session of its own, which it signals whole
        with open(os.devnull) as nothing:  # a rank must not read the server's requests
            os.dup2(nothing.fileno(), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        script = os.path.abspath(request["script"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(script)
        sys.path[1:1] = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
        code = run_as_main(script)
        exit_without_teardown(code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)  # never back into the server's loop


def run_as_main(script: str) -> int:
    """The script's exit code, as `python script` ends."""
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        return exit_code(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception (torch prefixes the rank)
        return 1


def exit_code(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # sys.exit("message"), as the interpreter shows it
    return 1


def exit_without_teardown(code: int) -> None:
    """End as an interpreter ends (threads stopped and joined, atexit handlers run,
    output flushed), but without tearing down every module: with torch loaded that took
    1.2 s of a 2.4 s run. Only what a script leaves to finalizers at exit is skipped; the
    tests of real launches still cover it."""
    threading._shutdown()  # what the interpreter calls first: stops executors, joins threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_all(pids: list[int], timeout: float) -> tuple[list[int], bool]:
    """Each rank's exit code (-N for signal N), after stopping the others once one fails."""
    codes: dict[int, int] = {}
    deadline, kill_at = time.monotonic() + timeout, None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and kill_at is None:
                signal_rest(pids, codes, signal.SIGTERM)
                kill_at = time.monotonic() + GRACE_S
            continue
        now = time.monotonic()
        if os.getppid() == 1:  # the test process died: nobody waits for this run
            deadline = now
        if now > deadline or (kill_at is not None and now > kill_at):
            signal_rest(pids, codes, signal.SIGKILL)
            if now > deadline:
                for pid in set(pids) - set(codes):
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                return [codes[pid] for pid in pids], True
        time.sleep(0.02)
    return [codes[pid] for pid in pids], False


def signal_rest(pids: list[int], codes: dict, signum: int) -> None:
    """Each rank still running, with what it started (its session's process group)."""
    for pid in pids:
        if pid not in codes:
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:  # not yet in its own session
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


def main() -> None:
    gc.freeze()  # what the imports made: each rank's full collections skip it, as they skip setup's
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()  # a child must not inherit anything unwritten
        pids = []
        for env in request["envs"]:
            pid = os.fork()
            if pid == 0:
                become_rank(request, env)
            pids.append(pid)
        try:
            returncodes, timed_out = wait_all(pids, request["timeout"])
        except BaseException:  # e.g. Ctrl-C: the ranks, in sessions of their own, would run on
            signal_rest(pids, {}, signal.SIGKILL)
            raise
        reply = {"id": request["id"], "returncodes": returncodes, "timed_out": timed_out}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
