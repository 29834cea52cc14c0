"""The generated project's own test suite, run inside a freshly baked project."""

import subprocess
import sys

from conftest import bake


def test_generated_project_suite_passes(tmp_path):
    project = bake(tmp_path, project_name="Suite Check")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout.splitlines()[-1]
