"""Baking the template: every choice renders, bad answers are refused, hostile text is safe."""

import ast
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import CHOICES, TEMPLATE, bake
from cookiecutter.exceptions import FailedHookException

# The top of a baked project: what the user edits, and one package of machinery.
USER_FILES = {"train.py", "evaluate.py", "export.py", "model.py", "data.py", "config.yaml"}
TOP_LEVEL = USER_FILES | {"engine", "tests", "scripts", "README.md", "LICENSE", "pyproject.toml"}


def rendered_files(project):
    return [p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_defaults_bake_a_complete_project(baked):
    assert baked.name == "ddp_classifier"
    assert {p.name for p in baked.iterdir() if not p.name.startswith(".")} == TOP_LEVEL
    assert {p.name for p in baked.glob("*.py")} == {"train.py", "evaluate.py", "export.py", "model.py", "data.py"}
    assert (baked / "scripts" / "slurm" / "train.sbatch").is_file()
    for path in rendered_files(baked):
        text = path.read_text()
        assert not re.search(r"{{\s*cookiecutter|{%", text), path  # nothing left unrendered
        if path.suffix == ".py":
            ast.parse(text, filename=str(path))


@pytest.mark.parametrize("license_name", CHOICES["license"])
def test_every_license_choice(tmp_path, license_name):
    project = bake(tmp_path, license=license_name, author="Ada Lovelace")
    text = (project / "LICENSE").read_text()
    assert "Ada Lovelace" in text
    spdx = {"Proprietary": "LicenseRef-Proprietary"}.get(license_name, license_name)
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["license"] == spdx


@pytest.mark.parametrize("version", CHOICES["python_version"])
def test_every_python_version_choice(tmp_path, version):
    project = bake(tmp_path, python_version=version)
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["requires-python"] == f">={version}"


@pytest.mark.parametrize(
    "slug, problem",
    [
        ("2fast", "is not a Python identifier"),
        ("my-project", "is not a Python identifier"),
        ("class", "is a Python keyword"),
        ("torch", "would shadow a module the project imports"),
        ("json", "would shadow a module the project imports"),
        ("engine", "is the name of one of the project's own modules"),
    ],
)
def test_bad_slug_is_refused_and_nothing_is_left(tmp_path, slug, problem):
    with pytest.raises(FailedHookException):
        bake(tmp_path, project_slug=slug)
    assert list(tmp_path.iterdir()) == []


def test_bad_slug_message_is_one_line_from_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(TEMPLATE), "--no-input", "-o", str(tmp_path), "project_slug=torch"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "error: project_slug 'torch' would shadow a module the project imports; rerun with e.g." in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == []


def test_name_is_turned_into_a_slug(tmp_path):
    assert bake(tmp_path, project_name="My Great Model").name == "my_great_model"


HOSTILE = 'It\'s "quoted"\nand\\back {{ cookiecutter.author }} {% if %} ${{ github }} \u00e9\U0001f600'


@pytest.mark.parametrize("key", ["project_name", "description", "author"])
def test_hostile_free_text_is_kept_verbatim_and_safe(tmp_path, key):
    project = bake(tmp_path, project_slug="hostile", **{key: HOSTILE})
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if key == "description":
        assert meta["description"] == HOSTILE
    if key == "author":
        assert meta["authors"][0]["name"] == HOSTILE
    for path in rendered_files(project):
        if path.suffix == ".py":
            ast.parse(path.read_text(), filename=str(path))


def test_hook_knows_every_module_of_the_project(baked):
    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    block = hook[hook.index("PROJECT_MODULES = {") : hook.index("}", hook.index("PROJECT_MODULES = {"))]
    for module in baked.glob("*.py"):
        assert f'"{module.stem}"' in block, f"add {module.stem!r} to PROJECT_MODULES"


def test_the_machinery_knows_no_task(baked):
    """Loss, metrics and batch structure are the user's: nothing of the classification
    example (its loss, its metric, its batch layout) appears in the engine package."""
    for path in (baked / "engine").glob("*.py"):
        text = path.read_text()
        for word in ("cross_entropy", "argmax", "val_acc", "num_classes", "labels", "images"):
            assert word not in text, f"{path.name} mentions {word!r}"


def test_the_machinerys_tests_train_a_frozen_copy_of_the_example(baked):
    """tests/reference_task is the example task, byte for byte, under a one-line header:
    the machinery's tests then hold whatever the user's model.py, data.py and config.yaml
    become, and test exactly what the user started from."""
    for name in ("model.py", "data.py", "config.yaml"):
        header, _, body = (baked / "tests" / "reference_task" / name).read_text().partition("\n")
        assert header.startswith("# The example task, frozen")
        assert body == (baked / name).read_text(), name
