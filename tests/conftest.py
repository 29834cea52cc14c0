"""Helpers for baking the template in tests."""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
CHOICES = json.loads((TEMPLATE / "cookiecutter.json").read_text())
# manifest.json: the files each yes/no answer owns. Its parts are the optional features
# (engine/parts, and tools such as the launcher); all "no" bakes the smallest project.
MANIFEST = json.loads((TEMPLATE / "manifest.json").read_text())
OWNED_FILES = {**MANIFEST["parts"], **MANIFEST["extras"]}
PART_ANSWERS = tuple(MANIFEST["parts"])
WITHOUT_PARTS = dict.fromkeys(PART_ANSWERS, "no")
EVERY_PART = dict.fromkeys(PART_ANSWERS, "yes")  # the default answers leave some parts out (fsdp)
# The bakes whose whole suites the template runs (test_generated_project.py): every part, and
# none with the second task.
WHOLE_SUITES = {"every part": EVERY_PART, "without parts": {**WITHOUT_PARTS, "task": CHOICES["task"][1]}}
BIN = Path(sys.executable).parent  # this environment's python, ruff, pytest, cruft, pre-commit
TOOLS_ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # them first on PATH


def bake(output_dir: Path, **answers) -> Path:
    """Generate a project with the default answers overridden by `answers`."""
    path = cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=answers)
    return Path(path)


@pytest.fixture
def baked(tmp_path):
    return bake(tmp_path)


def ci_workflow(project: Path) -> dict:
    return yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())


def ci_step(project: Path, name: str) -> dict:
    """The step called `name` of the baked project's CI job."""
    steps = ci_workflow(project)["jobs"]["test"]["steps"]
    return next(step for step in steps if step.get("name") == name)


# The longest first (by --durations on 2 cores), so that the other worker runs the short
# ones beside them instead of leaving one long test alone at the end; the SLURM group is
# scheduled as one.
LONGEST_FIRST = ("test_generated_project_passes_its_own_suite", "test_slurm.py", "test_each_other_task")


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, name in enumerate(LONGEST_FIRST) if name in item.nodeid), len(LONGEST_FIRST))

    items.sort(key=rank)  # a stable sort: the rest keep their order
