"""The generated project's own CI steps, run inside a freshly baked project: its lint
and its whole test suite, with the commands read from its .github/workflows/ci.yml.
Each other task's project lints and passes its task's tests and the config tests (which
check its config.yaml); its machinery and the machinery's tests are the same files as
the default project's, which pass in full."""

import filecmp
import subprocess

import pytest
from conftest import CHOICES, TOOLS_ENV, bake, ci_step

TASK_FILES = {"model.py", "data.py", "config.yaml", "README.md", "pyproject.toml", ".cookiecutter.json"}


def test_generated_project_passes_its_own_ci_steps(tmp_path):
    project = bake(tmp_path, project_name="Suite Check")
    commands = [
        line for name in ("Lint", "Test") for line in ci_step(project, name)["run"].splitlines() if line.strip()
    ]
    for command in commands:
        # The generated suite took 27-40 min here (the longer on a busy machine): a generous
        # limit, well inside CI's 90, until it is cut down (issue: tests in minutes).
        result = subprocess.run(
            command, shell=True, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=3600
        )
        assert result.returncode == 0, f"{command}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("task", CHOICES["task"][1:])
def test_each_other_task_lints_and_passes_its_own_tests(tmp_path, task):
    project = bake(tmp_path / task, task=task)
    default = bake(tmp_path / "default")
    differing = sorted(path for path in files(project) ^ files(default) | changed(project, default))
    assert set(differing) <= TASK_FILES | {"tests/test_task.py", "tests/test_data.py"}, differing
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
