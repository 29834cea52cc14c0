"""Removes what was not chosen, then prints the next steps. Runs inside the new project."""

import json
import os
from pathlib import Path

# The slug was checked by pre_gen_project.py: a plain identifier, safe in quotes.
SLUG = "{{ cookiecutter.project_slug }}"
SLURM_SCRIPT = "{{ cookiecutter.slurm_script }}" == "True"
TENSORBOARD = "{{ cookiecutter.tensorboard }}" == "True"
LAUNCHER = "{{ cookiecutter.launcher }}" == "True"
TRACKING = "{{ cookiecutter.tracking }}" == "True"
# What the answers no delete: the files manifest.json lists for each (local_extensions.py).
UNCHOSEN_FILES = json.loads({{ cookiecutter | unchosen_files | py_str }})

# Each example task is a folder of tasks/: the chosen one's files go to their places, and
# the machinery's tests get the classification example, with this project's train.py and
# recipe.py, as a frozen copy in tests/reference_task/.
TASK = "{{ cookiecutter.task }}"
TASKS = ("classification", "detection", "segmentation")
TASK_FILES = {
    "model.py": "model.py",
    "data.py": "data.py",
    "synthetic_data.py": "synthetic_data.py",
    "config.yaml": "config.yaml",
    "test_task.py": "tests/test_task.py",
    "test_data.py": "tests/test_data.py",
}
REFERENCE_TASK = "classification"
FROZEN = {
    **dict.fromkeys(("model.py", "data.py", "synthetic_data.py", "config.yaml"), "The example task"),
    "train.py": "The project's train.py",
    "recipe.py": "The project's recipe.py",
}


def remove(path: str) -> None:
    """Remove one of the template's files, then its folders if that left them empty (a
    re-bake over an existing project must not delete the user's own files)."""
    file = Path(path)
    file.unlink(missing_ok=True)
    for folder in file.parents[:-1]:  # up to, not including, the project folder
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def place_task() -> None:
    reference = Path("tests", "reference_task")
    reference.mkdir(exist_ok=True)
    for name, what in FROZEN.items():
        source = Path("tasks", REFERENCE_TASK, name) if name in TASK_FILES else Path(name)
        header = f"# {what}, frozen: the machinery's tests run it (tests/conftest.py).\n"
        (reference / name).write_text(header + source.read_text())
    for name, place in TASK_FILES.items():
        os.replace(Path("tasks", TASK, name), place)
    for task in TASKS:  # the others' files, one by one: a folder of the user's own stays
        for name in TASK_FILES:
            remove(f"tasks/{task}/{name}")


def remove_unchosen() -> None:
    for path in UNCHOSEN_FILES:
        remove(path)


def next_steps() -> str:
    launch = "python -m engine.launch" if LAUNCHER else "torchrun"
    lines = [
        f"Created {SLUG}/. Next steps:",
        "",
        f"  cd {SLUG}",
        "  python -m venv .venv && . .venv/bin/activate",
        '  pip install -e ".[dev]"                             # tests, lint, packages of the parts',
        # The README's launch: engine.launch is torchrun ending in the failing process's own line.
        f"  {launch} --standalone --nproc_per_node=2 train.py   # 2 processes (GPUs if present, else CPU)",
        "  python train.py                                     # or a single process",
        "  pytest                                              # the project's own tests",
    ]
    if TENSORBOARD and TRACKING:
        lines.append("  tensorboard --logdir runs                           # the curves")
    if SLURM_SCRIPT:
        lines.append("  sbatch scripts/slurm/train.sbatch                   # on a SLURM cluster")
    lines.append("  git init && pre-commit install                      # ruff on every commit")
    lines += ["", "Edit model.py, data.py, recipe.py and config.yaml; README.md says where everything else lives."]
    return "\n".join(lines)


if __name__ == "__main__":
    place_task()
    remove_unchosen()
    print("\n" + next_steps() + "\n")
