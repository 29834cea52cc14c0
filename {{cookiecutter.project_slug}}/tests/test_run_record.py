"""What a run leaves about itself: what produced it (engine/provenance.py: the git
commit and whether the code differed from it, the versions, the launch and its hosts), in
every checkpoint, the saved config's header and the run's opening line; and rank 0's
lines, in output_dir/train.log across resumes."""

import platform
import shutil
import socket
import subprocess

import torch
import yaml

from conftest import FAST, load_checkpoint, machinery_project, run_script

RUN = [*FAST, "data.train_size=256", "train.epochs=1"]


def git(folder, *args) -> str:
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    return subprocess.run(["git", *identity, *args], cwd=folder, check=True, capture_output=True, text=True).stdout


def test_a_run_records_its_commit_versions_and_hosts_in_a_repository_and_outside(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(machinery_project(), repo)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "the project")
    head = git(repo, "rev-parse", "HEAD").strip()

    runs = {"clean": repo, "outside": machinery_project()}
    for name, project in runs.items():
        out = tmp_path / name
        opening = run_script(str(project / "train.py"), [*RUN, f"output_dir={out}"], nproc=2, cwd=project).stdout
        ckpt = load_checkpoint(out / "checkpoints" / "last.pt")
        record = ckpt["provenance"]
        assert record["versions"]["torch"] == torch.__version__
        assert record["versions"]["python"] == platform.python_version()
        assert record["launch"] == {"launcher": "torchrun", "world_size": 2, "nodes": 1}
        assert record["hosts"] == [socket.gethostname()]
        saved = (out / "config.yaml").read_text()
        assert yaml.safe_load(saved)["output_dir"] == str(out)  # the header is comments: the config still loads
        if name == "clean":
            assert record["git"] == {"commit": head, "dirty": False}
            assert f"commit {head[:12]}" in opening and saved.startswith(f"# produced by commit {head[:12]}\n")
        else:
            assert record["git"] is None
            assert "no git commit (not a git repository)" in opening

    with (repo / "model.py").open("a") as f:
        f.write("# an edit not yet committed\n")
    out = tmp_path / "dirty"
    opening = run_script(str(repo / "train.py"), [*RUN, f"output_dir={out}"], cwd=repo).stdout
    assert load_checkpoint(out / "checkpoints" / "last.pt")["provenance"]["git"] == {"commit": head, "dirty": True}
    assert f"commit {head[:12]} (uncommitted changes)" in opening


def test_rank_0s_lines_go_to_train_log_across_resumes_with_the_error_that_ends_a_run(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "train.epochs=2", "train.log_every_steps=2", f"output_dir={out}"]
    first = run_script("train.py", [*args, "train.stop_at_step=5"], nproc=2).stdout
    second = run_script("train.py", args, nproc=2).stdout
    failed = run_script("train.py", [*args, "checkpoint.best_metric=val_nope"], nproc=2, check=False)
    assert failed.returncode != 0  # 2 from each rank; torchrun says 1

    logged = (out / "train.log").read_text().splitlines()
    printed = [*first.splitlines(), *second.splitlines()]
    assert [line for line in logged if line in printed] == printed  # every line, in order
    assert "stopped at step 5" in first and "resumed from" in second
    assert logged[-1] == failed.stderr.strip().splitlines()[-1]
    assert logged[-1].startswith("error: checkpoint.best_metric is 'val_nope'")
