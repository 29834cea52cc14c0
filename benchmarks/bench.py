"""Benchmark: the generated training loop against a minimal hand-written one.

Bakes a project with the default answers, then, for each workload and process count,
alternates runs of (a) its train.py and (b) benchmarks/handwritten.py with the same
model, data, augmentation, optimizer recipe, batch and process count. Prints median step
time with its spread over runs, samples/s, the minor page faults of the whole run, the
a/b ratio of each back-to-back pair (and whether their spread overlaps 1.0), start-up +
teardown time, per-epoch time outside training steps, peak memory per rank, and whether
both ended with the same weights. Then DDP vs FSDP peak memory on a larger model, and
(with --switches) the effect of each speed switch.

It asserts nothing about time; it prints. Usage (from the template repo):
    .venv/bin/python benchmarks/bench.py [--repeats 5] [--cases big small resnet] [--switches]
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
HANDWRITTEN = Path(__file__).with_name("handwritten.py")

# A step that is mostly compute, and the same math in both loops: no augmentation (the
# loops draw its randomness differently), constant lr, no weight decay.
WORKLOAD = [
    "model.name=mlp",
    "model.hidden_dim=512",
    "data.image_size=32",
    "data.train_size=8192",
    "data.val_size=1000",
    "train.num_workers=0",
    "data.augment=false",
    "train.batch_size=64",
    "train.epochs=2",
    "train.lr=0.05",
    "train.weight_decay=0",
    "train.schedule=constant",
    "train.log_every_steps=1000",
    "checkpoint.resume=none",
]
# Small steps (issue: where per-step overheads show): the default recipe (weight decay,
# cosine schedule, augmentation), a small MLP and batch 32.
SMALL_STEPS = [
    "model.name=mlp",
    "model.hidden_dim=256",
    "data.train_size=16384",
    "train.num_workers=0",
    "train.batch_size=32",
    "train.epochs=2",
    "train.log_every_steps=100000",
    "checkpoint.resume=none",
]
# The default model and recipe, batch 32 (a ResNet-18 step takes seconds on a CPU core).
RESNET = [
    "model.name=resnet18",
    "data.train_size=512",
    "train.num_workers=0",
    "train.batch_size=32",
    "train.epochs=1",
    "train.log_every_steps=100000",
    "checkpoint.resume=none",
]
CASES = {
    "big": ("MLP hidden 512, batch 64, no augmentation", WORKLOAD, [1, 2]),
    "small": ("MLP hidden 256, batch 32, default recipe with augmentation", SMALL_STEPS, [1, 2]),
    "resnet": ("ResNet-18, batch 32, default recipe with augmentation", RESNET, [1]),
}


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run(command: list[str], project: Path) -> tuple[str, float, int]:
    """Run to the end; returns its output, wall time and minor page faults (all processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    faults_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    start = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults_before


def run_generated(project: Path, nproc: int, out: Path, workload: list[str], extra=()) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    _, wall, faults = run([*launcher(nproc), "train.py", *workload, *extra, f"output_dir={out}"], project)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    inside = sum(e["train_time_s"] + e["outside_train_s"] for e in epochs)
    return {
        "step_s": statistics.median(e["step_time_median_s"] for e in epochs),
        "samples_per_s": statistics.mean(e["samples_per_s"] for e in epochs),
        "startup_teardown_s": wall - inside,
        "outside_per_epoch_s": statistics.mean(e["outside_train_s"] for e in epochs),
        "rss_peak_mib": [row["rss_peak_mib"] for row in epochs[-1]["memory"]],
        "faults": faults,
        "weights": torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"],
    }


def run_handwritten(project: Path, nproc: int, out: Path, workload: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "handwritten.pt"
    stdout, wall, faults = run([*launcher(nproc), str(HANDWRITTEN), json.dumps(workload), str(weights)], project)
    ranks = sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    return {
        "step_s": ranks[0]["step_time_median_s"],
        "samples_per_s": ranks[0]["samples_per_s"],
        "startup_teardown_s": wall - ranks[0]["train_time_s"],
        "outside_per_epoch_s": 0.0,
        "rss_peak_mib": [r["rss_peak_mib"] for r in ranks],
        "faults": faults,
        "weights": torch.load(weights, map_location="cpu", weights_only=True),
    }


def same_weights(a: dict, b: dict) -> str:
    if a.keys() != b.keys():
        return "different keys"
    if all(torch.equal(a[k], b[k]) for k in a):
        return "bitwise equal"
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    return f"max abs difference {worst:.2e}"


def compare_loops(project: Path, work: Path, repeats: int, case: str) -> None:
    title, workload, nprocs = CASES[case]
    print(f"\n== {title}: generated loop (a) vs hand-written loop (b), {repeats} alternating runs each")
    print("   workload: " + " ".join(workload))
    print("   step ms: median over runs of each run's median step (spread: min-max over runs)")
    print(
        f"{'procs':>5} {'loop':>4} {'step ms':>8} {'spread':>13} {'samples/s':>10} {'faults':>9} {'start+end s':>11} "
        f"{'outside/epoch s':>15}  peak RSS MiB per rank"
    )
    for nproc in nprocs:
        results = {"a": [], "b": []}
        for repeat in range(repeats):
            order = ("a", "b") if repeat % 2 == 0 else ("b", "a")  # alternate to cancel drift
            for loop in order:
                runner = run_generated if loop == "a" else run_handwritten
                results[loop].append(runner(project, nproc, work / f"{loop}{nproc}", workload))
        for loop in ("a", "b"):
            rows = results[loop]
            steps = [1e3 * r["step_s"] for r in rows]
            print(
                f"{nproc:>5} {loop:>4} {statistics.median(steps):>8.2f} {min(steps):>6.2f}-{max(steps):<6.2f} "
                f"{statistics.median(r['samples_per_s'] for r in rows):>10.0f} "
                f"{statistics.median(r['faults'] for r in rows):>9.0f} "
                f"{statistics.median(r['startup_teardown_s'] for r in rows):>11.2f} "
                f"{statistics.median(r['outside_per_epoch_s'] for r in rows):>15.3f}  "
                f"{[round(m) for m in rows[-1]['rss_peak_mib']]}"
            )
        print(f"{nproc:>5} {ratio_line(results)}")


def ratio_line(results: dict) -> str:
    """The a/b step-time ratio, with the spread of the back-to-back pairs (which share the
    machine's state at the time) and what that spread allows one to say."""
    median_a, median_b = (statistics.median(r["step_s"] for r in results[loop]) for loop in ("a", "b"))
    pairs = sorted(a["step_s"] / b["step_s"] for a, b in zip(results["a"], results["b"], strict=True))
    if pairs[0] <= 1.0 <= pairs[-1]:
        verdict = "the spread overlaps 1.0: no lead either way"
    else:
        verdict = "generated faster" if pairs[-1] < 1.0 else "generated slower"
    weights = same_weights(results["a"][-1]["weights"], results["b"][-1]["weights"])
    return (
        f"a/b median step-time ratio {median_a / median_b:.3f} (back-to-back pairs {pairs[0]:.3f}-{pairs[-1]:.3f}: "
        f"{', '.join(f'{p:.3f}' for p in pairs)}); {verdict}; final weights: {weights}"
    )


def compare_memory(project: Path, work: Path) -> None:
    print("\n== peak memory per rank, 2 processes, MLP with 29M parameters (hidden_dim=4096)")
    big = ["model.hidden_dim=4096", "data.train_size=2048", "train.batch_size=32", "train.epochs=1"]
    for strategy in ("ddp", "fsdp"):
        out = work / strategy
        run([*launcher(2), "train.py", *WORKLOAD, *big, f"train.strategy={strategy}", f"output_dir={out}"], project)
        memory = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["memory"]
        peaks = [row["rss_peak_mib"] for row in memory]
        now = [row["rss_mib"] for row in memory]
        print(f"{strategy:>5}: peak RSS {peaks} MiB, RSS after the epoch {now} MiB")


SWITCHES = {
    "baseline": [],
    "train.compile=true": ["train.compile=true"],
    "train.channels_last=true": ["train.channels_last=true"],
    "train.precision=bf16": ["train.precision=bf16"],
    "dist.static_graph=true": ["dist.static_graph=true"],
    "dist.bucket_cap_mb=1": ["dist.bucket_cap_mb=1"],
}


def compare_switches(project: Path, work: Path) -> None:
    print("\n== speed switches, generated loop, 2 processes (median step time; compile includes warm-up epochs)")
    for name, extra in SWITCHES.items():
        result = run_generated(project, 2, work / "switch", WORKLOAD, extra)
        print(f"{name:>26}: {1e3 * result['step_s']:7.2f} ms/step, {result['samples_per_s']:7.0f} samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--switches", action="store_true", help="also time each speed switch")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}; "
        f"torch {torch.__version__}, Python {platform.python_version()}; CPU processes, gloo"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work / "bake")))
        for case in args.cases:
            compare_loops(project, work, args.repeats, case)
        compare_memory(project, work)
        if args.switches:
            compare_switches(project, work)


if __name__ == "__main__":
    main()
