"""The generated project's own CI steps, run inside a freshly baked project: its lint
and its whole test suite, with the commands read from its .github/workflows/ci.yml."""

import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import bake

BIN = Path(sys.executable).parent


def ci_commands(project: Path, step_name: str) -> list[str]:
    workflow = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())
    step = next(s for s in workflow["jobs"]["test"]["steps"] if s.get("name") == step_name)
    return [line for line in step["run"].splitlines() if line.strip()]


def test_generated_project_passes_its_own_ci_steps(tmp_path):
    project = bake(tmp_path, project_name="Suite Check")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # this environment's ruff, pytest
    for command in ci_commands(project, "Lint") + ci_commands(project, "Test"):
        result = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, f"{command}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1]
