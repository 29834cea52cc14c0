"""Prints the next steps once the project is written."""

SLUG = {{ cookiecutter.project_slug | py_str }}

NEXT_STEPS = f"""
Created {SLUG}/. Next steps:

  cd {SLUG}
  python -m venv .venv && . .venv/bin/activate
  pip install -e ".[dev]"
  torchrun --nproc_per_node=2 train.py      # 2 processes (GPUs if present, else CPU)
  python train.py                           # or a single process
  pytest                                    # the project's own tests

Edit model.py, data.py and config.yaml; README.md says where everything else lives.
"""

if __name__ == "__main__":
    print(NEXT_STEPS)
