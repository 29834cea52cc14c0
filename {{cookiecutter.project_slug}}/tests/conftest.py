"""Shared helpers: run the project's scripts in real processes (forked ranks, python or torchrun).

Two kinds of tests live here. The machinery's tests (most files) train the reference
task in tests/reference_task, a frozen copy of the example (and of train.py and
recipe.py as generated), in a copy of this project (`machinery_project()`): they keep
passing whatever your model.py, data.py, recipe.py, train.py and config.yaml become.
Your task's tests (test_data.py, test_task.py) run on your files
(`PROJECT`, `project_config`); adapt them when you change the task.
"""

import atexit
import contextlib
import functools
import importlib.util
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import load_config

PROJECT = Path(__file__).resolve().parents[1]


def has(path: str) -> bool:
    """Whether this project has `path`, e.g. an optional part's module (its answer no deletes it)."""
    return (PROJECT / path).exists()


REFERENCE_TASK = PROJECT / "tests" / "reference_task"

# FSDP is a cookiecutter answer: without it (no engine/parts/fsdp.py, no fsdp: section),
# the tests that run under each strategy run under DDP only, and FSDP-only ones skip.
STRATEGIES = ["ddp", "fsdp"] if (PROJECT / "engine" / "parts" / "fsdp.py").exists() else ["ddp"]
needs_fsdp = pytest.mark.skipif("fsdp" not in STRATEGIES, reason="the project was generated without FSDP")


def strategy_args(strategy: str) -> list[str]:
    """The overrides that choose `strategy`: none for DDP, the default (without FSDP there is no fsdp.* key)."""
    return ["fsdp.enabled=true"] if strategy == "fsdp" else []


# Small and fast, for the reference task: the mlp model, tiny data, no worker processes.
FAST = [
    "model.name=mlp",
    "model.hidden_dim=32",
    "data.image_size=8",
    "data.train_size=1024",
    "data.val_size=101",
    "train.num_workers=0",
    "train.batch_size=16",
    "optim.lr=0.1",
    "data.augment=false",
    "train.log_every_steps=4",
    # The tracking part's curves: the tests that read them turn them on.
    *(["tracking.tensorboard=false"] if has("engine/parts/tracking.py") else []),
]


def project_config(path=None, overrides=(), base=None):
    """A config of your task: config.yaml's schema with data.py's, model.py's and recipe.py's sections."""
    from data import DataConfig
    from model import ModelConfig
    from recipe import OptimConfig

    return load_config(path, last_wins(overrides), base=base, data=DataConfig, model=ModelConfig, optim=OptimConfig)


def reference_config(path=None, overrides=(), base=None):
    """A config of the reference task, which the machinery's tests train."""
    task = reference_task()
    sections = {"data": task.data.DataConfig, "model": task.model.ModelConfig, "optim": task.recipe.OptimConfig}
    return load_config(path, last_wins(overrides), base=base, **sections)


@functools.cache
def reference_task() -> SimpleNamespace:
    """tests/reference_task's data, model and recipe modules, imported under their own names
    so that they never stand in for your data.py, model.py and recipe.py in this process."""
    synthetic = import_file("reference_task_synthetic_data", REFERENCE_TASK / "synthetic_data.py")
    # The reference data.py and model.py import their siblings by these names.
    with modules_as({"synthetic_data": synthetic}):
        data = import_file("reference_task_data", REFERENCE_TASK / "data.py")
    with modules_as({"data": data}):
        model = import_file("reference_task_model", REFERENCE_TASK / "model.py")
    recipe = import_file("reference_task_recipe", REFERENCE_TASK / "recipe.py")
    return SimpleNamespace(data=data, model=model, recipe=recipe)


@contextlib.contextmanager
def modules_as(modules: dict):
    """`modules` importable by their names for a while, then yours (or none) again."""
    yours = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in yours.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


def import_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect (config comments) and pickling find it by name
    spec.loader.exec_module(module)
    return module


@functools.cache
def machinery_project() -> Path:
    """A copy of this project's machinery with the reference task as its model.py, data.py
    and config.yaml, and the frozen train.py and recipe.py: where the machinery's tests run
    train.py, evaluate.py, export.py and predict.py."""
    root = Path(tempfile.mkdtemp(prefix="machinery-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    project = root / PROJECT.name
    shutil.copytree(PROJECT / "engine", project / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("evaluate.py", "export.py", "predict.py", "sweep.py"):
        if has(name):  # sweep.py: the sweep part's
            shutil.copy(PROJECT / name, project / name)
    for name in ("model.py", "data.py", "synthetic_data.py", "config.yaml", "train.py", "recipe.py"):
        shutil.copy(REFERENCE_TASK / name, project / name)
    return project


def command(script, args, nproc=None, torchrun_args=()):
    """The command line for a script, under torchrun when `nproc` is set (standalone unless
    `torchrun_args` name a rendezvous)."""
    launcher = [sys.executable]
    if nproc is not None:
        rendezvous = [] if any(arg.startswith("--rdzv") for arg in torchrun_args) else ["--standalone"]
        launcher += ["-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}", *torchrun_args]
    return [*launcher, script, *last_wins(args)]


def last_wins(args) -> list[str]:
    """`args` with each `key=value` setting once, at its last value: a test's own settings
    on top of FAST's (the config refuses a key given twice on the command line)."""
    args = list(map(str, args))
    keys = [arg.partition("=")[0] if "=" in arg and not arg.startswith("-") else None for arg in args]
    return [arg for i, (arg, key) in enumerate(zip(args, keys, strict=True)) if key is None or key not in keys[i + 1 :]]


def clean_env(extra=None) -> dict:
    """This environment without launcher variables (the tests may run under torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")
    for key in (*launcher, "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        env.pop(key, None)
    return {**env, **(extra or {})}


def run_script(
    script, args, nproc=None, env=None, timeout=240, check=True, torchrun_args=(), cwd=None, real_launcher=False
):
    """Run train.py/evaluate.py as `python` or, when `nproc` is set, as `nproc` ranks, in
    the machinery's copy of the project unless `cwd` says otherwise. The ranks are forked
    from a server that has imported torch (rank_server.py), with torchrun's variables.
    A fresh `python` or `torchrun` process runs instead when the launcher is under test
    (`real_launcher`, or any `torchrun_args`) or `env` sets a variable the server cannot
    give a forked rank (`FORKED_RANKS_TAKE`)."""
    cwd = cwd or machinery_project()
    env = clean_env(env)
    if real_launcher or torchrun_args or not forkable(env):
        result = subprocess.run(
            command(script, args, nproc, torchrun_args),
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        result = run_forked(script, args, nproc, env, timeout, cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


# What a forked rank can be given beyond the server's own environment: PYTHONPATH (the
# server puts it on sys.path) and what is read after start. Anything else (the C
# library's MALLOC_*, OMP_*, torch's import-time settings) needs a new process.
FORKED_RANKS_TAKE = ("PYTHONPATH", "WANDB_", "MLFLOW_")


def forkable(env: dict) -> bool:
    server_env = rank_server_env()
    changed = {name for name in env.keys() | server_env.keys() if env.get(name) != server_env.get(name)}
    changed.discard("PYTEST_CURRENT_TEST")  # pytest sets it for each test
    # torch sets it in this process the first time inductor looks for its cache (e.g. a test
    # that loads a torch.export program here): its default, which a forked rank finds alike.
    changed.discard("TORCHINDUCTOR_CACHE_DIR")
    return all(name.startswith(FORKED_RANKS_TAKE) for name in changed)


def run_forked(script, args, nproc, env, timeout, cwd) -> subprocess.CompletedProcess:
    """One run through the rank server; exit code 1 if any rank failed, as torchrun's."""
    envs = [env] if nproc is None else rank_environments(env, nproc)
    with tempfile.TemporaryDirectory(prefix="run-") as logs:
        out, err = Path(logs, "stdout"), Path(logs, "stderr")
        request = dict(script=str(script), args=last_wins(args), cwd=str(cwd), envs=envs, timeout=timeout)
        reply = ask_rank_server({**request, "stdout": str(out), "stderr": str(err), "id": logs})
        stdout, stderr = (path.read_text() if path.exists() else "" for path in (out, err))
    cmd = command(script, args, nproc)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    codes = reply["returncodes"]
    returncode = codes[0] if nproc is None else int(any(codes))
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def ask_rank_server(request: dict) -> dict:
    """Its reply to this request; a server that failed is stopped and the next run starts another."""
    server = rank_server()
    try:
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = json.loads(server.stdout.readline() or "null")
        if reply is None or reply["id"] != request["id"]:
            raise AssertionError(f"the rank server stopped or lost track (exit {server.poll()}, reply {reply})")
        return reply
    except BaseException:
        server.kill()
        rank_server.cache_clear()
        raise


def rank_environments(env: dict, nproc: int) -> list[dict]:
    """What torchrun --standalone gives each of `nproc` ranks on this machine."""
    world = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    world |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port()), "TORCHELASTIC_RESTART_COUNT": "0"}
    world["TORCHELASTIC_RUN_ID"] = os.urandom(16).hex()  # --standalone makes up a random one per launch
    return [{**env, **world, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]


def rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range, which rank 0 binds a moment later:
    ports the kernel hands out in the meantime (gloo's, other tests') come from that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(low // 2, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


@functools.cache
def rank_server_env() -> dict:
    """The environment the rank server starts with (torch reads some of it at import)."""
    return clean_env()


@functools.cache
def rank_server() -> subprocess.Popen:
    """This test process's rank server, started at its first run and stopped at its exit."""
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("rank_server.py"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=rank_server_env(),
        text=True,
    )
    atexit.register(server.stdin.close)  # the server ends at the end of its input
    return server


def start_script(script, args, nproc=None, env=None, torchrun_args=()) -> subprocess.Popen:
    """Start a script in the background, its output (stderr merged) readable line by line."""
    return subprocess.Popen(
        command(script, args, nproc, torchrun_args),
        cwd=machinery_project(),
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


def wait_for_line(process: subprocess.Popen, needle: str, seen: list, timeout=120) -> str:
    """Read the process's output until a line contains `needle`; keeps all lines in `seen`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"exited before {needle!r}:\n{''.join(seen)}")
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} within {timeout} s:\n{''.join(seen)}")


def finish(process: subprocess.Popen, seen: list, timeout=120) -> str:
    """Wait for the process to end; returns its whole output."""
    rest, _ = process.communicate(timeout=timeout)
    seen.append(rest)
    return "".join(seen)


def free_port() -> int:
    """A TCP port nobody listens on right now, for a rendezvous on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (torchrun's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real file system that fills up. Needs the right to mount (root, or
    CAP_SYS_ADMIN in a container); skipped with the reason where that is refused."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def fast_args():
    return list(FAST)


def tensors(tree, prefix=""):
    """Every tensor in a nested state dict, by path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    found = {}
    for key, value in items:
        found |= tensors(value, f"{prefix}/{key}")
    return found


def assert_one_epoch_trains_on_one_process(train_args, output_dir: Path) -> None:
    """Your task, the edit loop's check: one epoch on one process gives finite metrics and
    a checkpoint."""
    run_script("train.py", [*train_args, "train.epochs=1", f"output_dir={output_dir}"], cwd=PROJECT)
    (row,) = read_metrics(output_dir)
    assert all(math.isfinite(value) for value in row.values() if isinstance(value, float)), row
    assert (output_dir / "checkpoints" / "last.pt").is_file()


def evaluate_on_1_2_and_3_processes(train_args, output_dir: Path) -> list[dict]:
    """Your task: train one epoch, then evaluate its last.pt on 1, 2 and 3 processes with
    batches of one sample (so every forward gives the same bits). The three results."""
    run_script("train.py", [*train_args, "train.epochs=1", f"output_dir={output_dir}"], cwd=PROJECT)
    args = ["--checkpoint", output_dir / "checkpoints" / "last.pt", "train.eval_batch_size=1"]
    runs = [run_script("evaluate.py", args, nproc=nproc, cwd=PROJECT) for nproc in (None, 2, 3)]
    return [json.loads(run.stdout.splitlines()[-1]) for run in runs]


def predict_on_1_and_2_processes(train_args, output_dir: Path, images=5) -> list[dict]:
    """Your task: train one epoch, then predict.py on a folder of `images` noise images of
    odd sizes, on 1 and 2 processes in batches of 2 (the same file, checked here). Its rows."""
    from PIL import Image

    run_script("train.py", [*train_args, "train.epochs=1", f"output_dir={output_dir}"], cwd=PROJECT)
    photos = output_dir / "photos"
    photos.mkdir()
    generator = torch.Generator().manual_seed(0)
    for index in range(images):
        pixels = torch.randint(0, 256, (20 + index, 27, 3), dtype=torch.uint8, generator=generator)
        Image.fromarray(pixels.numpy()).save(photos / f"{index}.png")
    texts = []
    for nproc in (None, 2):
        out = output_dir / f"predictions-{nproc or 1}.jsonl"
        args = ["--checkpoint", output_dir / "checkpoints" / "last.pt", "--inputs", photos, "--out", out]
        run_script("predict.py", [*args, "train.eval_batch_size=2"], nproc=nproc, cwd=PROJECT)
        texts.append(out.read_text())
    assert texts[0] == texts[1]
    rows = [json.loads(line) for line in texts[0].splitlines()]
    assert [row["input"] for row in rows] == [str(photos / f"{index}.png") for index in range(images)]
    return rows


def assert_resume_is_bitwise(train_args, output_dir: Path, nproc, stop_at: int, cwd=PROJECT) -> tuple[dict, str]:
    """Your task: a run stopped after optimizer step `stop_at` and started again ends with
    the same weights, optimizer state and validation metrics as the run left alone. Returns
    the whole run's last checkpoint and what the resumed run printed."""
    whole, split = output_dir / "whole", output_dir / "split"
    run_script("train.py", [*train_args, f"output_dir={whole}"], nproc=nproc, cwd=cwd)
    args = [*train_args, f"output_dir={split}"]
    run_script("train.py", [*args, f"train.stop_at_step={stop_at}"], nproc=nproc, cwd=cwd)
    resumed = run_script("train.py", args, nproc=nproc, cwd=cwd).stdout
    assert "resumed from" in resumed

    a, b = (load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split))
    assert a["step"] == b["step"] > stop_at
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    # A resumed epoch's train_* figures average only the steps after the resume.
    validation = [
        {k: v for k, v in m.items() if k.startswith("val_") or k == "num_samples"} for m in read_metrics(whole)
    ]
    assert validation == [{k: m[k] for k in v} for m, v in zip(read_metrics(split), validation, strict=True)]
    return a, resumed


def project_with(tmp_path, edits: dict) -> Path:
    """A copy of the machinery's project with some of its user files edited: {name: edit(text) -> text}."""
    project = tmp_path / "project"
    shutil.copytree(machinery_project(), project)
    for name, edit in edits.items():
        (project / name).write_text(edit((project / name).read_text()))
    return project


def replaced(text: str, pairs) -> str:
    """`text` with each (old, new) pair replaced; each `old` must be there."""
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new)
    return text
