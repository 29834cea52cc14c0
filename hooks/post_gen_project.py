"""Removes what was not chosen, then prints the next steps. Runs inside the new project."""

from pathlib import Path

# The slug was checked by pre_gen_project.py: a plain identifier, safe in quotes.
SLUG = "{{ cookiecutter.project_slug }}"
CI_WORKFLOW = "{{ cookiecutter.ci_workflow }}" == "True"
SLURM_SCRIPT = "{{ cookiecutter.slurm_script }}" == "True"
TENSORBOARD = "{{ cookiecutter.tensorboard }}" == "True"


def remove(path: str) -> None:
    """Remove one of the template's files, then its folders if that left them empty (a
    re-bake over an existing project must not delete the user's own files)."""
    file = Path(path)
    file.unlink(missing_ok=True)
    for folder in file.parents[:-1]:  # up to, not including, the project folder
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def remove_unchosen() -> None:
    if not CI_WORKFLOW:
        remove(".github/workflows/ci.yml")
    if not SLURM_SCRIPT:
        remove("scripts/slurm/train.sbatch")


def next_steps() -> str:
    lines = [
        f"Created {SLUG}/. Next steps:",
        "",
        f"  cd {SLUG}",
        "  python -m venv .venv && . .venv/bin/activate",
        '  pip install -e ".[dev]"                             # tests, lint, tensorboard',
        "  torchrun --standalone --nproc_per_node=2 train.py   # 2 processes (GPUs if present, else CPU)",
        "  python train.py                                     # or a single process",
        "  pytest                                              # the project's own tests",
    ]
    if TENSORBOARD:
        lines.append("  tensorboard --logdir runs                           # the curves")
    if SLURM_SCRIPT:
        lines.append("  sbatch scripts/slurm/train.sbatch                   # on a SLURM cluster")
    lines.append("  git init && pre-commit install                      # ruff on every commit")
    lines += ["", "Edit model.py, data.py and config.yaml; README.md says where everything else lives."]
    return "\n".join(lines)


if __name__ == "__main__":
    remove_unchosen()
    print("\n" + next_steps() + "\n")
