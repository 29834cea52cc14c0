"""Helpers for baking the template in tests."""

import json
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
CHOICES = json.loads((TEMPLATE / "cookiecutter.json").read_text())


def bake(output_dir: Path, **answers) -> Path:
    """Generate a project with the default answers overridden by `answers`."""
    path = cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=answers)
    return Path(path)


@pytest.fixture
def baked(tmp_path):
    return bake(tmp_path)
