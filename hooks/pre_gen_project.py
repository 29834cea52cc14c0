"""Checks the answers before cookiecutter writes any file.

A bad answer stops generation with one line saying what to change; cookiecutter then
leaves nothing behind. Answers are read through `py_str`, so quotes, backslashes and
newlines in them cannot break this script.
"""

import keyword
import sys

SLUG = {{ cookiecutter.project_slug | py_str }}

# Modules the generated project imports, or is made of: a slug equal to one of these
# would shadow it (and `pip install -e .` would replace the real distribution).
PROJECT_MODULES = {
    "data",
    "engine",
    "evaluate",
    "export",
    "model",
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


def slug_problem(slug: str) -> str | None:
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


def main() -> int:
    problem = slug_problem(SLUG)
    if problem:
        print(
            f"error: project_slug {SLUG!r} {problem}; rerun with e.g. project_slug=my_ddp_project",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
