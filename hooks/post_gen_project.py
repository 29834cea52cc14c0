"""Removes what was not chosen, then prints the next steps. Runs inside the new project."""

from pathlib import Path

# The slug was checked by pre_gen_project.py: a plain identifier, safe in quotes.
SLUG = "{{ cookiecutter.project_slug }}"
CI_WORKFLOW = "{{ cookiecutter.ci_workflow }}" == "True"
SLURM_SCRIPT = "{{ cookiecutter.slurm_script }}" == "True"
TENSORBOARD = "{{ cookiecutter.tensorboard }}" == "True"

# Each optional part (engine/parts): its answer, and the files that are all of it.
PARTS = {
    "ema": "{{ cookiecutter.ema }}" == "True",
    "early_stopping": "{{ cookiecutter.early_stopping }}" == "True",
    "freezing": "{{ cookiecutter.freezing }}" == "True",
    "profiler": "{{ cookiecutter.profiler }}" == "True",
    "tracking": "{{ cookiecutter.tracking }}" == "True",
    "memory_report": "{{ cookiecutter.memory_report }}" == "True",
    "throughput": "{{ cookiecutter.throughput }}" == "True",
    "run_record": "{{ cookiecutter.run_record }}" == "True",
    "host_tuning": "{{ cookiecutter.host_tuning }}" == "True",
    "pretrained": "{{ cookiecutter.pretrained }}" == "True",
    "launcher": "{{ cookiecutter.launcher }}" == "True",
    "sweep": "{{ cookiecutter.sweep }}" == "True",
    "fsdp": "{{ cookiecutter.fsdp }}" == "True",
}
PART_FILES = {
    "ema": ["engine/parts/ema.py", "tests/test_ema.py", "docs/ema.md"],
    "early_stopping": ["engine/parts/early_stopping.py", "tests/test_early_stopping.py", "docs/early-stopping.md"],
    "freezing": ["engine/parts/freeze.py", "tests/test_freezing.py", "docs/freezing.md"],
    "profiler": ["engine/parts/profiler.py", "tests/test_profiling.py", "docs/profiler.md"],
    "tracking": ["engine/parts/tracking.py", "tests/test_trackers.py", "tests/test_tensorboard.py", "docs/tracking.md"],
    "memory_report": ["engine/parts/memory.py", "tests/test_memory_report.py", "docs/memory.md"],
    "throughput": ["engine/throughput.py", "tests/test_throughput.py"],
    "run_record": ["engine/run_record.py", "tests/test_run_record.py"],
    "host_tuning": ["engine/host.py", "tests/test_host.py"],
    "pretrained": ["engine/pretrained.py", "tests/test_pretrained.py", "docs/pretrained.md"],
    "launcher": ["engine/launch.py", "tests/test_launcher.py"],  # a tool, not a Part
    "sweep": ["sweep.py", "engine/supervisor.py", "tests/test_sweep.py"],  # a tool too
    "fsdp": [
        "engine/parts/fsdp.py",
        "engine/sharded.py",
        "tests/test_fsdp.py",
        "tests/test_fsdp_tied.py",
        "tests/sharded_setup.py",
        "docs/fsdp.md",
    ],
}


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
    for part, chosen in PARTS.items():
        if not chosen:
            for path in PART_FILES[part]:
                remove(path)


def next_steps() -> str:
    launch = "python -m engine.launch" if PARTS["launcher"] else "torchrun"
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
    if TENSORBOARD and PARTS["tracking"]:
        lines.append("  tensorboard --logdir runs                           # the curves")
    if SLURM_SCRIPT:
        lines.append("  sbatch scripts/slurm/train.sbatch                   # on a SLURM cluster")
    lines.append("  git init && pre-commit install                      # ruff on every commit")
    lines += ["", "Edit model.py, data.py, recipe.py and config.yaml; README.md says where everything else lives."]
    return "\n".join(lines)


if __name__ == "__main__":
    remove_unchosen()
    print("\n" + next_steps() + "\n")
