"""The generated project's own CI steps, run inside a freshly baked project: its lint
and its whole test suite, with the commands read from its .github/workflows/ci.yml."""

import subprocess

from conftest import TOOLS_ENV, bake, ci_step


def test_generated_project_passes_its_own_ci_steps(tmp_path):
    project = bake(tmp_path, project_name="Suite Check")
    commands = [
        line for name in ("Lint", "Test") for line in ci_step(project, name)["run"].splitlines() if line.strip()
    ]
    for command in commands:
        result = subprocess.run(
            command, shell=True, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=2400
        )
        assert result.returncode == 0, f"{command}:\n{result.stdout[-6000:]}{result.stderr[-3000:]}"
    assert " passed" in result.stdout.splitlines()[-1]
