"""What produced a run: the code's git commit, the versions, the launch and its hosts.

Recorded in every checkpoint ("provenance") and in the header of output_dir/config.yaml;
the run's opening line says the commit. A project outside a git repository (or without
git) records no commit, and says so.
"""

import importlib.metadata
import platform
import socket
import subprocess
from pathlib import Path

import torch

from engine.distributed import DistEnv, all_gather_objects, broadcast_from_main, is_main


def describe_run(env: DistEnv, code: Path) -> dict:
    """The run's provenance, the same on every rank: `code` is the project's folder.
    Every rank must call this (it gathers the host names)."""
    hosts = all_gather_objects(socket.gethostname())
    return {
        "git": broadcast_from_main(git_state(code) if is_main() else None),  # one git call per job
        "versions": versions(),
        "launch": {"launcher": env.launcher, "world_size": env.world_size, "nodes": len(set(hosts))},
        "hosts": list(dict.fromkeys(hosts)),  # in rank order, each once
    }


def git_state(folder: Path) -> dict | None:
    """{"commit": sha, "dirty": whether tracked or new files differ from it}; None outside
    a git repository."""
    try:
        head = git(folder, "rev-parse", "HEAD")
        changes = git(folder, "status", "--porcelain") if head else ""
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return None
    return {"commit": head, "dirty": bool(changes)} if head else None


def git(folder: Path, *args: str) -> str:
    """git's output, or "" where it fails (e.g. not a repository)."""
    done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else ""


def versions() -> dict:
    cuda = torch.cuda.is_available()
    try:
        torchvision = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        torchvision = None
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass, which a weights-only load refuses
        "torchvision": torchvision,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def commit_line(provenance: dict) -> str:
    """E.g. 'commit 1a2b3c4d5e6f (uncommitted changes)', for the run's opening line."""
    state = provenance["git"]
    if state is None:
        return "no git commit (not a git repository)"
    return f"commit {state['commit'][:12]}{' (uncommitted changes)' if state['dirty'] else ''}"


def header(provenance: dict) -> str:
    """Comment lines for the top of the saved config: what produced the run."""
    launch, found = provenance["launch"], provenance["versions"]
    shown = ", ".join(f"{name} {version}" for name, version in found.items() if version)
    return (
        f"# produced by {commit_line(provenance)}\n# {shown}\n"
        f"# {launch['world_size']} process(es) on {launch['nodes']} node(s) ({launch['launcher']}): "
        f"{shown_hosts(provenance['hosts'])}\n"
    )


def shown_hosts(hosts: list[str], most: int = 8) -> str:
    more = f" and {len(hosts) - most} more" if len(hosts) > most else ""
    return ", ".join(hosts[:most]) + more
