"""A generated project's own tests check the user's task, not the example's recipe: a
config.yaml written out in full (defaults repeated) passes the edit loop, and a test that
depends on the example says in one line what to adapt when the task changes."""

import subprocess
import sys

from conftest import TOOLS_ENV, bake

# A recipe ported from elsewhere, written out in full: several values repeat their defaults.
PORTED_CONFIG = """\
model:
  name: mlp
  label_smoothing: 0.1
optim:
  name: sgd
  lr: 0.5
  momentum: 0.9
  weight_decay: 0.0005
train:
  batch_size: 64
  grad_clip: 5.0
"""


def pytest_in(project, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=900)


def test_a_recipe_written_out_in_full_passes_the_edit_loop_and_the_examples_tests_say_what_to_adapt(tmp_path):
    project = bake(tmp_path)
    (project / "config.yaml").write_text(PORTED_CONFIG)
    quick = pytest_in(project, "-m", "quick")
    assert quick.returncode == 0, quick.stdout[-4000:]
    recipe = pytest_in(project, "tests/test_task.py", "-k", "learns_on_any_number_of_processes and 1-mlp")
    assert recipe.returncode == 1, recipe.stdout[-4000:]  # the example's lr, not this recipe's
    assert "the example recipe's lr line: after changing recipe.py or optim:, write your recipe's lr here" in (
        recipe.stdout
    )
