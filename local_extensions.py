"""Keeps free-text cookiecutter answers literal and safe in every generated file.

Cookiecutter renders each answer as a Jinja template, so an answer holding `{{`, `{%` or
`{#` (e.g. a description mentioning `${{ github.ref }}`) would be evaluated or crash with a
traceback. `SafeStringsExtension` keeps such answers as plain text; its filters then turn
an answer into a literal that each target file's parser reads back exactly, and write
the answers for the baked project's .cookiecutter.json.
"""

import json
import logging
import os
import re
from pathlib import Path

from jinja2.ext import Extension

TEMPLATE_ROOT = Path(__file__).resolve().parent
JINJA_MARKUP = re.compile(r"{{|{%|{#")


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

    collect(json.loads((TEMPLATE_ROOT / "cookiecutter.json").read_text()))
    for path in TEMPLATE_ROOT.rglob("*"):
        sources.add(path.name)
    for hook in (TEMPLATE_ROOT / "hooks").glob("*"):
        sources.add(hook.read_text())
    return sources


class HookFailureWithoutTraceback(logging.Filter):
    """Our hooks print the reason for a failure in one line; cookiecutter then logs the
    failure with its own traceback, which says nothing more. Drop that traceback."""

    def filter(self, record):
        if record.getMessage().startswith("Stopping generation because"):
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
        environment.filters.update(py_str=py_str, toml_str=toml_str, one_line=one_line, answers_json=answers_json)
        self.trusted = template_sources()
        self.literals = {}

    def preprocess(self, source, name, filename=None):
        """Turn an answer that contains Jinja markup into a reference to its literal text."""
        if name is not None or source in self.trusted or not JINJA_MARKUP.search(source):
            return source
        key = self.literals.setdefault(source, f"_literal_answer_{len(self.literals)}")
        self.environment.globals[key] = source
        return "{{ " + key + " }}"
