"""The template's Python files as a maintainer edits them: Python as they stand in this
repo, linted here and not only once baked. The files that still hold Jinja are listed, and
the list only shrinks: a file freed of it leaves the list, and no file may join it."""

import ast
import subprocess

from conftest import BIN, TEMPLATE

PROJECT_TEMPLATE = TEMPLATE / "{{cookiecutter.project_slug}}"
STILL_JINJA = {
    "engine/checkpoint.py",
    "engine/logs.py",
    "engine/training.py",
    "evaluate.py",
    "train.py",
}
# The baked project's ruff settings (its pyproject.toml, which itself holds Jinja), with its
# own modules named: in tasks/<task>/ the task's modules are not where a bake has them.
FIRST_PARTY = ["engine", "data", "model", "recipe", "synthetic_data", "train"]
FIRST_PARTY += sorted(path.stem for path in (PROJECT_TEMPLATE / "tests").glob("*.py"))  # tests import each other
RUFF = ["--isolated", "--no-cache", "--line-length", "120", "--target-version", "py310"]
LINT = [
    *RUFF,
    "--select",
    "E,F,W,I,B,UP",
    "--config",
    f"lint.isort.known-first-party = {FIRST_PARTY}",
]


def python_files() -> list[str]:
    return sorted(
        str(path.relative_to(PROJECT_TEMPLATE))
        for path in PROJECT_TEMPLATE.rglob("*.py")
        if "__pycache__" not in path.parts
    )


def holds_jinja(path: str) -> bool:
    text = (PROJECT_TEMPLATE / path).read_text()
    try:
        ast.parse(text)
    except SyntaxError:
        return True
    return "{%" in text


def test_only_the_listed_files_hold_jinja():
    assert {path for path in python_files() if holds_jinja(path)} == STILL_JINJA


def test_the_python_files_lint_and_are_formatted_as_they_stand():
    files = [path for path in python_files() if path not in STILL_JINJA]
    for command in ([BIN / "ruff", "check", *LINT, *files], [BIN / "ruff", "format", "--check", *RUFF, *files]):
        result = subprocess.run(command, cwd=PROJECT_TEMPLATE, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
