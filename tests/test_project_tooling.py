"""The baked project as a well-kept Python project: lint, CI workflow, pre-commit,
optional parts, recorded answers (replay, cruft), hygiene. And this repo's own lint."""

import base64
import functools
import hashlib
import http.server
import itertools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from conftest import BIN, CHOICES, TEMPLATE, TOOLS_ENV, bake, ci_step, ci_workflow
from cookiecutter.main import cookiecutter


def run(command, cwd, check=True):
    result = subprocess.run(command, cwd=cwd, env=TOOLS_ENV, capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


VARIANTS = [
    {"python_version": version, "ci_workflow": on, "slurm_script": on, "tensorboard": on, "task": task}
    for version, on, task in zip(
        CHOICES["python_version"], [True, False, True, False], itertools.cycle(CHOICES["task"]), strict=False
    )
]


@pytest.mark.parametrize("answers", VARIANTS, ids=lambda a: f"py{a['python_version']}-{a['ci_workflow']}-{a['task']}")
def test_every_variant_lints_clean(tmp_path, answers):
    project = bake(tmp_path, **answers)
    run(["ruff", "check", "."], project)
    run(["ruff", "format", "--check", "."], project)


def test_rebaking_without_a_part_keeps_the_users_own_files(tmp_path):
    project = bake(tmp_path)
    (project / "scripts" / "deploy.sh").write_text("echo mine\n")
    (project / ".github" / "dependabot.yml").write_text("version: 2\n")
    off = {"ci_workflow": "no", "slurm_script": "no"}
    cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(tmp_path), overwrite_if_exists=True, extra_context=off)
    assert (project / "scripts" / "deploy.sh").is_file() and (project / ".github" / "dependabot.yml").is_file()
    assert not (project / "scripts" / "slurm").exists() and not (project / ".github" / "workflows").exists()


def test_unchosen_parts_are_removed(tmp_path):
    full = bake(tmp_path / "full")
    bare = bake(tmp_path / "bare", ci_workflow="no", slurm_script="no", tensorboard="no")
    assert (full / ".github" / "workflows" / "ci.yml").is_file() and (full / "scripts" / "slurm").is_dir()
    assert not (bare / ".github").exists() and not (bare / "scripts").exists()
    assert "sbatch" in (full / "README.md").read_text() and "sbatch" not in (bare / "README.md").read_text()
    assert "tensorboard" not in (full / "config.yaml").read_text()  # on: the schema's default
    assert "tensorboard: false" in (bare / "config.yaml").read_text()


def test_ci_workflow_is_valid_yaml_with_install_lint_and_test_steps(tmp_path):
    project = bake(tmp_path, python_version="3.12")
    workflow = ci_workflow(project)
    assert workflow["concurrency"]["group"] == "${{ github.workflow }}-${{ github.ref }}"
    steps = workflow["jobs"]["test"]["steps"]
    setup = next(step for step in steps if step.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["python-version"] == "3.12"
    assert 'pip install -e ".[dev]"' in ci_step(project, "Install")["run"]
    assert ci_step(project, "Lint")["run"].split("\n")[:2] == ["ruff check .", "ruff format --check ."]
    assert ci_step(project, "Test")["run"].strip() == "pytest -n 2"


# The first major of each action that runs on Node 24 (GitHub removes its Node 20 runtime
# in 2026): checkout v5, setup-python v6, per their release notes.
NODE_24_MAJORS = {"actions/checkout": 5, "actions/setup-python": 6}


def test_ci_actions_run_on_node_24(tmp_path):
    steps = ci_workflow(bake(tmp_path))["jobs"]["test"]["steps"]
    actions = [step["uses"].split("@") for step in steps if "uses" in step]
    assert {name for name, _ in actions} == set(NODE_24_MAJORS)  # a new action: look up its Node 24 major
    for name, version in actions:
        assert int(version.removeprefix("v")) >= NODE_24_MAJORS[name], f"{name}@{version} runs on Node 20"


def test_project_installs_with_the_standard_command(tmp_path):
    project = bake(tmp_path)
    # The CI's install step without downloads: dependencies are already here.
    result = run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation", "-e", "."], project
    )
    assert "Would install ddp_classifier-0.1.0" in result.stdout


def test_pre_commit_runs_ruff_and_catches_unformatted_code(tmp_path):
    project = bake(tmp_path)
    run(["git", "init", "-q"], project)
    run(["git", "add", "-A"], project)
    assert "ruff format" in run(["pre-commit", "run", "--all-files"], project).stdout
    (project / "model.py").write_text((project / "model.py").read_text() + "\nx = [1,2]\n")
    run(["git", "add", "-A"], project)
    assert run(["pre-commit", "run", "--all-files"], project, check=False).returncode != 0


def test_answers_are_recorded_and_replay_the_same_project(tmp_path):
    project = bake(tmp_path / "first", project_name="Replay Me", license="BSD-3-Clause", tensorboard="no")
    answers = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    assert answers["project_slug"] == "replay_me" and answers["license"] == "BSD-3-Clause"
    assert answers["tensorboard"] is False
    assert str(tmp_path) not in (project / ".cookiecutter.json").read_text()  # no paths of this machine
    assert str(TEMPLATE) not in (project / ".cookiecutter.json").read_text()
    second = tmp_path / "second"
    second.mkdir()
    run([str(BIN / "cookiecutter"), "--replay-file", str(project / ".cookiecutter.json"), str(TEMPLATE)], second)
    assert run(["diff", "-r", str(project), str(second / "replay_me")], tmp_path).stdout == ""


def template_repo(tmp_path: Path) -> Path:
    """This template's working tree as a git repository with one commit (what cruft clones)."""
    repo = tmp_path / "template"
    shutil.copytree(TEMPLATE, repo, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*_cache", "__pycache__"))
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "template"]):
        run([*command[:1], "-c", "user.name=t", "-c", "user.email=t@t", *command[1:]], repo)
    return repo


def test_cruft_create_and_check_against_the_template(tmp_path):
    repo = template_repo(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    run([str(BIN / "cruft"), "create", "--no-input", str(repo)], out)
    project = out / "ddp_classifier"
    assert (
        json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]["project_slug"] == "ddp_classifier"
    )
    run([str(BIN / "cruft"), "check"], project)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nchanged\n")
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "newer template"], repo)
    assert run([str(BIN / "cruft"), "check"], project, check=False).returncode != 0  # now out of date


def test_cruft_update_to_a_newer_version_keeps_the_users_edits(tmp_path):
    """A project generated from one version of the template takes in the next version's
    changes (a new line in a docs page, a new version number) and keeps the user's own
    edit to model.py."""
    repo = template_repo(tmp_path)
    git = lambda *args, cwd=repo: run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd)  # noqa: E731
    git("tag", "v1.0.0")
    page = repo / "{{cookiecutter.project_slug}}" / "docs" / "config.md"
    page.write_text(page.read_text() + "\nA line that version 1.1.0 adds.\n")
    questions = repo / "cookiecutter.json"
    questions.write_text(re.sub(r'"_template_version": "[^"]+"', '"_template_version": "1.1.0"', questions.read_text()))
    git("commit", "-qam", "the next version")
    git("tag", "v1.1.0")

    out = tmp_path / "out"
    out.mkdir()
    run([str(BIN / "cruft"), "create", "--no-input", "--checkout", "v1.0.0", str(repo)], out)
    project = out / "ddp_classifier"
    git("init", "-q", cwd=project)
    git("add", "-A", cwd=project)
    git("commit", "-qm", "generated", cwd=project)
    edit = "\n\ndef my_helper():  # the user's own code\n    return 42\n"
    (project / "model.py").write_text((project / "model.py").read_text() + edit)
    git("commit", "-qam", "my model", cwd=project)

    run([str(BIN / "cruft"), "update", "--checkout", "v1.1.0", "--skip-apply-ask"], project)
    assert (project / "model.py").read_text().endswith(edit)
    assert "A line that version 1.1.0 adds." in (project / "docs" / "config.md").read_text()
    assert json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]["_template_version"] == "1.1.0"


def test_the_template_version_is_the_changelogs_newest(baked):
    newest = re.search(r"^## (\d+\.\d+\.\d+) ", (TEMPLATE / "CHANGELOG.md").read_text(), flags=re.M).group(1)
    assert json.loads((TEMPLATE / "cookiecutter.json").read_text())["_template_version"] == newest
    assert json.loads((baked / ".cookiecutter.json").read_text())["cookiecutter"]["_template_version"] == newest


def test_line_endings_and_executable_scripts(baked):
    assert "* text=auto eol=lf" in (baked / ".gitattributes").read_text()
    assert os.stat(baked / "scripts" / "slurm" / "train.sbatch").st_mode & stat.S_IXUSR
    tracked = run(["git", "ls-files", "-s", "--", "*train.sbatch"], TEMPLATE).stdout
    assert tracked.startswith("100755"), "the template repo must track train.sbatch as executable"
    for path in baked.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert b"\r\n" not in path.read_bytes(), path
    ignored = (baked / ".gitignore").read_text().split()
    assert {"runs/", "*.pt", ".venv/", "__pycache__/", ".ruff_cache/", "mlflow.db", "mlruns/"} <= set(ignored)


def test_template_repo_passes_its_own_lint():
    run(["ruff", "check", "."], TEMPLATE)
    run(["ruff", "format", "--check", "."], TEMPLATE)


def test_uv_takes_torchs_cpu_or_cuda_build_by_the_extra_named(tmp_path):
    """The baked pyproject's [tool.uv] settings, with PyTorch's two indexes stood in for by
    local ones (download.pytorch.org is out of reach here) holding stand-in wheels:
    `--extra cpu` and `--extra cu130` each take their build of torch and torchvision from
    their index, neither takes PyPI's, and both at once are refused."""
    project = bake(tmp_path / "bake")
    indexes = tmp_path / "indexes"
    for build in ("cpu", "cu130"):
        stand_in_wheel(indexes / build, "torch", f"2.14.1+{build}")
        stand_in_wheel(indexes / build, "torchvision", f"0.29.1+{build}", requires=["torch==2.14.1"])
    pyproject = project / "pyproject.toml"
    assert pyproject.read_text().count("https://download.pytorch.org/whl/") == 2
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(indexes))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        local = f"http://127.0.0.1:{server.server_address[1]}/"
        pyproject.write_text(pyproject.read_text().replace("https://download.pytorch.org/whl/", local))
        env = {**TOOLS_ENV, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
        uv = [str(BIN / "uv"), "--no-progress"]
        locked = subprocess.run([*uv, "lock"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert locked.returncode == 0, locked.stderr[-3000:]
        for extra in ("cpu", "cu130"):
            export = [*uv, "export", "--frozen", "--no-hashes", "--extra", extra, "--extra", "dev"]
            listed = subprocess.run(export, cwd=project, env=env, capture_output=True, text=True, timeout=60).stdout
            torch_lines = sorted(line for line in listed.splitlines() if line.startswith(("torch==", "torchvision==")))
            assert torch_lines == [f"torch==2.14.1+{extra}", f"torchvision==0.29.1+{extra}"], listed
        both = [*uv, "sync", "--frozen", "--dry-run", "--extra", "cpu", "--extra", "cu130"]
        refused = subprocess.run(both, cwd=project, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "incompatible" in refused.stderr, refused.stderr
    finally:
        server.shutdown()


def stand_in_wheel(index: Path, name: str, version: str, requires=()) -> None:
    """A wheel that holds only its metadata, listed in a PEP 503 page at index/name/."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={digest(text)},{len(text)}" for path, text in files.items()]
    files[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    wheel = index / name / f"{name}-{version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    (wheel.parent / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')


def digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
