"""The template's Python files as a maintainer edits them: Python as they stand in this
repo, with no Jinja block in any (an answer is a set of files: a "no" deletes them), linted
here and not only once baked."""

import ast
import subprocess

from conftest import BIN, TEMPLATE

PROJECT_TEMPLATE = TEMPLATE / "{{cookiecutter.project_slug}}"
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


def test_every_python_file_is_python_as_it_stands_with_no_jinja_block():
    files = python_files()
    assert len(files) > 80 and "engine/checkpoint.py" in files and "train.py" in files
    for path in files:
        text = (PROJECT_TEMPLATE / path).read_text()
        ast.parse(text, filename=path)  # a SyntaxError names the file
        assert "{%" not in text, f"{path} holds a Jinja block"


def test_the_python_files_lint_and_are_formatted_as_they_stand():
    files = python_files()
    for command in ([BIN / "ruff", "check", *LINT, *files], [BIN / "ruff", "format", "--check", *RUFF, *files]):
        result = subprocess.run(command, cwd=PROJECT_TEMPLATE, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
