"""Keeps free-text cookiecutter answers literal and safe in every generated file, and
refuses bad answers in one line before any file is written.

Cookiecutter renders each answer as a Jinja template, so an answer holding `{{`, `{%` or
`{#` (e.g. a description mentioning `${{ github.ref }}`) would be evaluated or crash with a
traceback. `SafeStringsExtension` keeps such answers as plain text; its filters then turn
an answer into a literal that each target file's parser reads back exactly, and write
the answers for the baked project's .cookiecutter.json. Its `refuse_bad_answers` filter,
which hooks/pre_gen_project.py calls, checks all the answers.
"""

import json
import keyword
import logging
import os
import re
import sys
import unicodedata
from pathlib import Path

from cookiecutter.exceptions import FailedHookException
from jinja2.ext import Extension
from slugify import slugify  # what cookiecutter's `slugify` filter calls

TEMPLATE_ROOT = Path(__file__).resolve().parent
JINJA_MARKUP = re.compile(r"{{|{%|{#")

# Answers that are one line by nature, with an example of each. They reach the package
# metadata (the slug is its name, the description its Summary, the author its Author), the
# licence's copyright line and the README's title. setuptools writes author and description
# raw into the wheel's METADATA, where a line break starts a header of the answer's choosing:
# author 'Bob\nRequires-Dist: evilpkg' made `pip install -e .` install evilpkg.
ONE_LINE_ANSWERS = {
    "project_name": "project_name='My DDP Project'",
    "project_slug": "project_slug=my_ddp_project",
    "description": "description='Image classification with DDP'",
    "author": "author='Ada Lovelace'",
}
# Unicode categories of line breaks, tabs and other control characters (and escape
# sequences, which begin with one): Cc control, Zl line separator, Zp paragraph separator.
NOT_ONE_LINE = {"Cc", "Zl", "Zp"}

# Modules the generated project imports, or is made of: a slug equal to one of these
# would shadow it (and `pip install -e .` would replace the real distribution).
PROJECT_MODULES = {
    "data",
    "engine",
    "evaluate",
    "export",
    "model",
    "predict",
    "recipe",
    "sweep",
    "synthetic_data",
    "train",
    "tests",
    "conftest",
}
THIRD_PARTY_MODULES = {
    "torch",
    "torchvision",
    "yaml",
    "pyyaml",
    "tqdm",
    "numpy",
    "PIL",
    "pillow",
    "pytest",
    "tensorboard",
    "cookiecutter",
    "setuptools",
    "pip",
}


def py_str(value: object) -> str:
    """A Python string literal."""
    return repr(str(value))


def toml_str(value: object) -> str:
    """A TOML basic string (double-quoted, with escapes)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = []
    for char in str(value):
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def one_line(value: object) -> str:
    """The text on one line, for Markdown headings and comments."""
    return re.sub(r"\s+", " ", str(value)).strip()


def answers_json(context) -> str:
    """The answers as a cookiecutter replay file (`cookiecutter --replay-file`), for the
    baked project's .cookiecutter.json. Paths of the machine that baked it are left out,
    the template's too when it was a local folder (a URL or gh:owner/repo is kept)."""
    local = {"_output_dir", "_repo_dir"}
    if Path(os.path.expanduser(str(context.get("_template", "")))).exists():
        local.add("_template")
    answers = {key: value for key, value in dict(context).items() if key not in local}
    return json.dumps({"cookiecutter": answers}, indent=2, ensure_ascii=False)


def template_questions() -> dict:
    """cookiecutter.json: the questions, their defaults and the choices of each."""
    return json.loads((TEMPLATE_ROOT / "cookiecutter.json").read_text())


def template_sources() -> set[str]:
    """The Jinja strings this template itself renders with `from_string`: values in
    cookiecutter.json, file and folder names, and hook scripts."""
    sources = set()

    def collect(value):
        if isinstance(value, str):
            sources.add(value)
        elif isinstance(value, list):
            for item in value:
                collect(item)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)

    collect(template_questions())
    project = TEMPLATE_ROOT / "{{cookiecutter.project_slug}}"  # the names cookiecutter renders
    sources.add(project.name)
    for path in project.rglob("*"):  # not the whole checkout: a .venv there holds 170,000 paths
        sources.add(path.name)
    for hook in (TEMPLATE_ROOT / "hooks").glob("*"):
        sources.add(hook.read_text())
    return sources


def manifest() -> dict:
    """manifest.json: the files each yes/no answer owns."""
    return json.loads((TEMPLATE_ROOT / "manifest.json").read_text())


def owned_files() -> dict[str, list[str]]:
    """Each yes/no answer of the manifest, with the files it owns."""
    entries = manifest()
    return {**entries["parts"], **entries["extras"]}


def unchosen_files(answers: dict) -> str:
    """The files the answers `no` delete, as JSON, for hooks/post_gen_project.py."""
    unchosen = [path for answer, paths in owned_files().items() if not answers[answer] for path in paths]
    return json.dumps(sorted(unchosen))


def shown(answer: object) -> str:
    """An answer as it was given, bounded: it is quoted in a one-line error."""
    if not isinstance(answer, str):
        return repr(answer)
    return repr(answer) if len(answer) <= 60 else repr(answer[:57]) + "..."


def one_line_problem(answers: dict) -> str | None:
    for key, example in ONE_LINE_ANSWERS.items():
        text = str(answers.get(key, ""))
        breaking = next((char for char in text if unicodedata.category(char) in NOT_ONE_LINE), None)
        if breaking is not None:
            return f"{key} {shown(text)} is not one line of text (it holds {breaking!r}); rerun with e.g. {example}"
    return None


def name_problem(answers: dict) -> str | None:
    name = str(answers.get("project_name", ""))
    if not any(char.isalnum() for char in name):
        return f"project_name {shown(name)} has no letter or digit; rerun with e.g. {ONE_LINE_ANSWERS['project_name']}"
    return None


def slug_fault(slug: str) -> str | None:
    """What is wrong with `slug` as a folder and module name, or None."""
    if not slug.isidentifier() or not slug.isascii():
        return "is not a Python identifier (use letters, digits and _, not starting with a digit)"
    if keyword.iskeyword(slug) or keyword.issoftkeyword(slug):
        return "is a Python keyword"
    lowered = slug.lower()
    if lowered in PROJECT_MODULES:
        return "is the name of one of the project's own modules"
    if lowered in {name.lower() for name in THIRD_PARTY_MODULES | set(sys.stdlib_module_names)}:
        return "would shadow a module the project imports"
    return None


def slug_problem(answers: dict) -> str | None:
    slug, name = str(answers.get("project_slug", "")), str(answers.get("project_name", ""))
    fault = slug_fault(slug)
    if fault is None:
        return None
    # A slug the user did not give comes from the name: say which answer to change.
    made_from = f" (made from project_name {shown(name)})" if slug == slugify(name, separator="_") else ""
    return f"project_slug {shown(slug)}{made_from} {fault}; rerun with e.g. {ONE_LINE_ANSWERS['project_slug']}"


def choice_problem(answers: dict, questions: dict) -> str | None:
    """A replay file, or cruft's answers, may hold a choice outside its list: the command
    line's key=value is checked by cookiecutter itself, these are not."""
    for key, choices in questions.items():
        if isinstance(choices, list) and not key.startswith("_") and answers.get(key) not in choices:
            listed = ", ".join(choices)
            return f"{key} {shown(answers.get(key))} is not one of {listed}; rerun with e.g. {key}={choices[0]}"
    return None


def boolean_problem(answers: dict, questions: dict) -> str | None:
    """Only true and false: post_gen_project.py would read any other value as no."""
    for key, default in questions.items():
        if isinstance(default, bool) and not isinstance(answers.get(key), bool):
            example = "yes" if default else "no"
            return f"{key} {shown(answers.get(key))} is not yes or no; rerun with e.g. {key}={example}"
    return None


def answer_problem(answers: dict) -> str | None:
    """The first bad answer, as an `error:` line saying what to change; None if all are good."""
    questions = template_questions()
    problems = (
        one_line_problem(answers),
        name_problem(answers),
        slug_problem(answers),
        choice_problem(answers, questions),
        boolean_problem(answers, questions),
    )
    problem = next((found for found in problems if found), None)
    return None if problem is None else f"error: {problem}"


class AnswerRefused(FailedHookException):
    """A bad answer, refused while cookiecutter renders hooks/pre_gen_project.py. That happens
    in cookiecutter's own process, before the hook script runs: cookiecutter then removes the
    project folder and its command line prints this one line alone. (A hook script that
    printed it and exited non-zero would be followed by 'Hook script failed (exit status: 1)'.)"""


def refuse_bad_answers(answers: dict) -> str:
    problem = answer_problem(dict(answers))
    if problem:
        raise AnswerRefused(problem)
    return ""


class HookFailureWithoutTraceback(logging.Filter):
    """A hook failure is said in one line (a refused answer, or a hook script's own line);
    cookiecutter then logs the failure with its own traceback, which says nothing more. Drop
    that traceback, and the whole log line after a refused answer: the command line prints
    the refusal itself."""

    def filter(self, record):
        if not record.getMessage().startswith("Stopping generation because"):
            return True
        if record.exc_info and isinstance(record.exc_info[1], AnswerRefused):
            return False
        record.exc_info, record.exc_text = None, None
        return True


def quiet_hook_failures() -> None:
    hooks_logger = logging.getLogger("cookiecutter.hooks")
    if not any(isinstance(f, HookFailureWithoutTraceback) for f in hooks_logger.filters):
        hooks_logger.addFilter(HookFailureWithoutTraceback())


class SafeStringsExtension(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        quiet_hook_failures()
        environment.filters.update(
            py_str=py_str,
            toml_str=toml_str,
            one_line=one_line,
            answers_json=answers_json,
            refuse_bad_answers=refuse_bad_answers,
            unchosen_files=unchosen_files,
        )
        self.trusted = template_sources()
        self.literals = {}

    def preprocess(self, source, name, filename=None):
        """Turn an answer that contains Jinja markup into a reference to its literal text."""
        if name is not None or source in self.trusted or not JINJA_MARKUP.search(source):
            return source
        key = self.literals.setdefault(source, f"_literal_answer_{len(self.literals)}")
        self.environment.globals[key] = source
        return "{{ " + key + " }}"
