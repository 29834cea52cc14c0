"""manifest.json, the one list of the files each yes/no answer owns, agrees with what uses
it: cookiecutter.json's questions and prompts, the README's answers table, and the bakes
(an answer no deletes exactly its files, and nothing left refers to one of them)."""

import json
import re
import shutil
import subprocess

import pytest
from conftest import BIN, CHOICES, MANIFEST, OWNED_FILES, TEMPLATE, WITHOUT_PARTS, bake

PROJECT_TEMPLATE = TEMPLATE / "{{cookiecutter.project_slug}}"


def test_the_manifests_answers_are_the_yes_no_questions_each_with_a_prompt():
    yes_no = {key for key, default in CHOICES.items() if isinstance(default, bool)}
    assert set(OWNED_FILES) == yes_no
    assert not set(MANIFEST["parts"]) & set(MANIFEST["extras"])
    assert [answer for answer in OWNED_FILES if answer not in CHOICES["__prompts__"]] == []


def test_every_file_the_manifest_lists_is_in_the_template_once():
    listed = [path for paths in OWNED_FILES.values() for path in paths]
    assert len(listed) == len(set(listed))
    assert [path for path in listed if not (PROJECT_TEMPLATE / path).is_file()] == []


def test_the_readmes_answers_table_has_a_row_naming_each_answers_modules():
    readme = (TEMPLATE / "README.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `(\w+)` \|.*$", readme, re.MULTILINE)}
    assert [answer for answer in OWNED_FILES if answer not in rows] == []
    modules = [(a, p) for a, paths in OWNED_FILES.items() for p in paths if p.endswith(".py") and "tests/" not in p]
    assert [f"{a}: {p}" for a, p in modules if p.rsplit("/", 1)[-1] not in rows[a]] == []


def references(path: str) -> re.Pattern | None:
    """How another file depends on the project file `path`: a module imported by its dotted
    name or, beside it (tests/), by its own; a docs page linked to."""
    name = path.rsplit("/", 1)[-1]
    if path.endswith(".py"):
        beside_tests = path.startswith("tests/") and path.count("/") == 1
        dotted = {path.removesuffix(".py").replace("/", "."), *([name.removesuffix(".py")] if beside_tests else [])}
        modules = "|".join(re.escape(m) for m in dotted)
        return re.compile(rf"^\s*(from|import) ({modules})\b", re.MULTILINE)
    if path.endswith(".md"):
        return re.compile(rf"\]\(([\w./-]*/)?{re.escape(name)}[)#]")
    return None


def manifest_problems(full, bare, removed: list[str]) -> list[str]:
    """What disagrees between a bake with every answer yes (`full`), one with the answers of
    `removed` no (`bare`), and the files the manifest says those answers own (`removed`)."""
    files = ({str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} for root in (full, bare))
    full_files, bare_files = (files_ - {".cookiecutter.json"} for files_ in files)
    unlisted = full_files - bare_files - set(removed)
    problems = [f"{path}: deleted, but no answer in manifest.json owns it" for path in sorted(unlisted)]
    problems += [f"{path}: listed in manifest.json, but kept" for path in set(removed) & bare_files]
    for kept in sorted(bare_files):
        text = (bare / kept).read_text(errors="replace")
        for path in removed:
            if (pattern := references(path)) and pattern.search(text):
                problems.append(f"{kept}: refers to {path}, which its answer's no deletes: list it beside it")
    texts = {kept: (bare / kept).read_text(errors="replace") for kept in bare_files if kept.endswith(".py")}
    for module in sorted(kept for kept in texts if is_library(kept)):
        others = [text for kept, text in texts.items() if kept != module]
        used = [references(module)]
        if module.startswith("tests/"):  # a test helper may be run as a script: by its name in quotes
            used.append(re.compile(rf"[\"']{re.escape(module.rsplit('/', 1)[-1])}[\"']"))
        if not any(pattern.search(text) for pattern in used for text in others):
            problems.append(f"{module}: no file of the bake imports it: list it with the answer that uses it")
    return problems


def is_library(path: str) -> bool:
    """A module that is only imported: not a script, a test or a package's __init__."""
    name = path.rsplit("/", 1)[-1]
    helper = path.startswith("engine/") or path.count("/") == 1 and path.startswith("tests/")
    return helper and name != "__init__.py" and not name.startswith(("test_", "conftest"))


def without_every_answer() -> dict:
    return {**WITHOUT_PARTS, **dict.fromkeys(MANIFEST["extras"], "no")}


def test_a_bake_with_every_answer_no_deletes_exactly_the_manifests_files_and_keeps_no_reference(tmp_path):
    full, bare = bake(tmp_path / "full"), bake(tmp_path / "bare", **without_every_answer())
    removed = [path for paths in OWNED_FILES.values() for path in paths]
    assert manifest_problems(full, bare, removed) == []


@pytest.mark.parametrize(
    ("answer", "forgotten"),
    [("ema", "tests/test_ema.py"), ("fsdp", "engine/sharded.py"), ("fsdp", "tests/sharded_setup.py")],
)
def test_a_file_missing_from_its_answers_entry_is_found(tmp_path, answer, forgotten):
    """A copy of the template whose manifest forgets one file of an answer."""
    template = tmp_path / "template"
    junk = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache")
    shutil.copytree(TEMPLATE, template, ignore=junk)
    entries = json.loads((template / "manifest.json").read_text())
    entries["parts"][answer].remove(forgotten)
    (template / "manifest.json").write_text(json.dumps(entries))
    baked = []
    for name, answers in (("full", {}), ("bare", without_every_answer())):
        command = [BIN / "cookiecutter", template, "--no-input", "-o", tmp_path / name]
        command += [f"{key}={value}" for key, value in answers.items()]
        subprocess.run(command, check=True, capture_output=True, cwd=tmp_path)  # no other local_extensions.py
        baked.append(tmp_path / name / "ddp_classifier")
    removed = [path for paths in {**entries["parts"], **entries["extras"]}.values() for path in paths]
    problems = manifest_problems(*baked, removed)
    assert problems and all(problem.startswith(f"{forgotten}: ") for problem in problems), problems
