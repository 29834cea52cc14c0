"""The generated project's own CI steps, run inside a freshly baked project: its lint,
read from its .github/workflows/ci.yml, and its whole test suite (both tiers), in parts.
The bake with every part (the default answers leave FSDP out) runs it all; the bake without
parts (with the second task) runs its task's tests, and the machinery's tests of every file
from which a "no" removed a part's code (WITHOUT_PARTS_RUNS): its other files are the bake
with every part's (checked below). Each other task's project lints and passes its task's
tests and the config tests (which check its config.yaml); its machinery and the machinery's
tests are the same files as the default project's, which the bake with every part holds and
passes in full."""

import filecmp
import subprocess
from pathlib import Path

import pytest
from conftest import CHOICES, EVERY_PART, MANIFEST, TOOLS_ENV, WHOLE_SUITES, bake, ci_step

TASK_FILES = {
    *("model.py", "data.py", "synthetic_data.py", "config.yaml"),
    *("README.md", "pyproject.toml", ".cookiecutter.json"),
}


# The generated suite in parts of about equal time (measured with --durations on 2 cores),
# so that `make test`'s workers share them with the SLURM tests and the rest; one nested
# `pytest -n 2` would leave one worker with the whole suite.
SUITE_PARTS = {
    "faults": ["test_faults.py"],
    # test_checkpoint.py here: its tests of a project without FSDP run in the bake without parts.
    "task and exactness": ["test_task.py", "test_exactness.py", "test_data.py", "test_config.py", "test_checkpoint.py"],
    "training and launch": [
        "test_train.py",
        "test_task_interface.py",
        "test_launch.py",
        "test_launcher.py",
        "test_divergence.py",
        "test_recipe.py",
        "test_ports.py",
        "test_metrics.py",
        "test_no_data_lost.py",
        "test_distributed.py",
    ],
    "memory, fsdp, streams and entry points": [
        "test_memory.py",
        "test_fsdp.py",
        "test_fsdp_tied.py",
        "test_common_changes.py",
        "test_streaming.py",
        "test_predict.py",
        "test_entry_points.py",
    ],
    "daily loop and units": ["test_run_lock.py", "test_batch.py"],
}
# A part's own tests (manifest.json) join the last group unless a group above lists them:
# adding a part adds no line here.
LISTED = {name for names in SUITE_PARTS.values() for name in names}
SUITE_PARTS["daily loop and units"] += sorted(
    {Path(path).name for files in MANIFEST["parts"].values() for path in files if path.startswith("tests/test_")}
    - LISTED
)
# What the bake without parts runs of it: its own task's tests, and the tests of the core run
# with no part loaded: training, checkpoints, stops and faults, evaluation, every entry point
# under real torchrun. Its other tests run the same files as the bake with every part (checked below:
# a "no" deletes files and changes no line of the others), with fewer parts loaded; its own CI
# runs them all.
WITHOUT_PARTS_RUNS = ("faults", "task and exactness", "training and launch", "memory, fsdp, streams and entry points")

# The bake without parts carries the second example task: its own suite then runs that task's
# tests beside the machinery's, and the task needs no separate run below.
BAKES = WHOLE_SUITES
SUITE_TASKS = {answers.get("task", CHOICES["task"][0]) for answers in BAKES.values()}


@pytest.mark.parametrize("answers", BAKES.values(), ids=BAKES.keys())
def test_generated_project_lints_and_its_ci_runs_the_whole_suite(tmp_path, answers):
    project = bake(tmp_path, project_name="Suite Check", **answers)
    for command in [line for line in ci_step(project, "Lint")["run"].splitlines() if line.strip()]:
        result = subprocess.run(command, shell=True, cwd=project, env=TOOLS_ENV, capture_output=True, text=True)
        assert result.returncode == 0, f"{command}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    # The parts below are both tiers of that suite: the plain one and the slow one.
    assert [ci_step(project, step)["run"].strip() for step in ("Test", "Slow tests")] == [
        "pytest -n 2",
        "pytest -n 2 -m slow",
    ]
    test_files = sorted(path.name for path in (project / "tests").glob("test_*.py"))
    listed = sorted(name for part in SUITE_PARTS.values() for name in part)
    assert (listed if answers == EVERY_PART else sorted(set(listed) & set(test_files))) == test_files


SUITE_RUNS = [
    pytest.param(part, answers, id=f"{part_name}-{bake_name}")
    for part_name, part in SUITE_PARTS.items()
    for bake_name, answers in BAKES.items()
    if answers == EVERY_PART or part_name in WITHOUT_PARTS_RUNS
]


@pytest.mark.parametrize(("part", "answers"), SUITE_RUNS)
def test_generated_project_passes_its_own_suite(tmp_path, part, answers):
    project = bake(tmp_path, project_name="Suite Check", **answers)
    names = [name for name in part if (project / "tests" / name).is_file()]  # a part left out takes its tests
    every_tier = "slow or not slow"  # the project's addopts leave the slow tier out
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", every_tier]
    command += [f"tests/{name}" for name in names]
    result = subprocess.run(command, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"{part}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1] and " failed" not in result.stdout.splitlines()[-1]


def test_a_no_deletes_files_and_changes_no_line_of_the_others(tmp_path):
    """Every Python file both bakes have, but the task's own, is byte for byte the same: the
    core reaches the parts through their hooks, never through lines an answer cuts."""
    every, without = (
        bake(tmp_path / "every", **BAKES["every part"]),
        bake(tmp_path / "without", **BAKES["without parts"]),
    )
    task_files = {"model.py", "data.py", "synthetic_data.py", "tests/test_task.py", "tests/test_data.py"}
    shared = {name for name in files(without) & files(every) if name.endswith(".py")} - task_files
    assert {"train.py", "engine/checkpoint.py", "engine/lifecycle.py", "tests/test_train.py"} <= shared
    differing = {name for name in shared if (every / name).read_bytes() != (without / name).read_bytes()}
    assert not differing, sorted(differing)


def test_the_quick_subset_selects_config_data_and_a_one_process_run_of_the_task(tmp_path):
    """What `pytest -m quick` selects; the parts above run each of these tests."""
    project = bake(tmp_path, project_name="Suite Check")
    command = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "quick", "--collect-only"]
    result = subprocess.run(command, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    files = {line.split("::")[0] for line in selected}
    assert files == {"tests/test_config.py", "tests/test_data.py", "tests/test_task.py"}, files
    assert [line for line in selected if line.startswith("tests/test_task.py")] == [
        "tests/test_task.py::test_your_task_trains_evaluates_and_saves_on_one_process"
    ]


@pytest.mark.parametrize("task", CHOICES["task"][1:])
def test_each_other_task_lints_and_passes_its_own_tests(tmp_path, task):
    project = bake(tmp_path / task, task=task)
    default = bake(tmp_path / "default")
    differing = sorted(path for path in files(project) ^ files(default) | changed(project, default))
    assert set(differing) <= TASK_FILES | {"tests/test_task.py", "tests/test_data.py"}, differing
    if task in SUITE_TASKS:
        return  # a bake above lints and runs its whole suite
    lint = [line for line in ci_step(project, "Lint")["run"].splitlines() if line.strip()]
    for command in [*lint, "python -m pytest -q tests/test_task.py tests/test_data.py tests/test_config.py"]:
        result = subprocess.run(
            command, shell=True, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=1200
        )
        assert result.returncode == 0, f"{command}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1]


def files(project) -> set[str]:
    return {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def changed(project, other) -> set[str]:
    common = files(project) & files(other)
    return {name for name in common if not filecmp.cmp(project / name, other / name, shallow=False)}
