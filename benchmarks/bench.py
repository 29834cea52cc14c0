"""Benchmark: the generated training loop against a minimal hand-written one, and against
the previous version's.

First, for the default and the lean bake (every optional answer no): time per training
sample of the generated loop over that of a plain loop (benchmarks/handwritten.py) over the
same model.py and data.py, and over that of the bake of the commit that set the previous
_template_version, 1 process each, pairs of runs side by side on a core each; the ratios,
their median and spread. `--quick` runs this alone, short, as the template's CI does.

Then it bakes a project with the default answers, then, for each workload and process count,
runs pairs of (a) its train.py and (b) benchmarks/handwritten.py with the same model,
data, augmentation, optimizer recipe, batch and process count: side by side on a core
each for one process, one after the other (order alternating) for more. Prints median step
time with its spread over runs, samples/s, the minor page faults of the whole run, the
a/b ratio of each pair of runs (and whether their spread overlaps 1.0), start-up +
teardown time, per-epoch time outside training steps, peak memory per rank, and whether
both ended with the same weights. Then DDP vs FSDP peak memory on a larger model, and
(with --switches) the effect of each speed switch.

It asserts nothing about time; it prints. Usage (from the template repo):
    .venv/bin/python benchmarks/bench.py [--repeats 8] [--cases big small resnet] [--switches] [--quick]
"""

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

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
    "optim.lr=0.05",
    "optim.weight_decay=0",
    "optim.schedule=constant",
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


@dataclass
class Started:
    command: list[str]
    process: subprocess.Popen
    start_s: float
    stdout: IO[str]  # temporary files, not pipes: nothing to drain while waiting
    stderr: IO[str]


@dataclass
class Finished:
    stdout: str
    wall_s: float
    faults: int  # minor page faults of the command and every process it waited for


def start(command: list[str], project: Path, cpu: int | None = None) -> Started:
    """Start a command, pinned to core `cpu` if given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=project, env=env, stdout=stdout, stderr=stderr)
    if cpu is not None:
        os.sched_setaffinity(process.pid, {cpu})  # at once: before it has imported anything
    return Started(command, process, time.perf_counter(), stdout, stderr)


def wait_all(started: list[Started]) -> list[Finished]:
    """Wait for started commands, each timed to its own end, with its own page faults
    (wait4's, not those of commands beside it). A failure stops the rest and the bench."""
    finished, pending = {}, list(started)
    try:
        while pending:
            for run_ in list(pending):
                pid, status, usage = os.wait4(run_.process.pid, os.WNOHANG)
                if pid:
                    # Tell Popen it has been reaped: it must not wait for this pid again.
                    run_.process.returncode = os.waitstatus_to_exitcode(status)
                    finished[id(run_)] = collect(run_, time.perf_counter() - run_.start_s, usage.ru_minflt)
                    pending.remove(run_)
            time.sleep(0.01)
    finally:
        for run_ in pending:
            run_.process.kill()
            run_.process.wait()
    return [finished[id(run_)] for run_ in started]


def collect(run_: Started, wall_s: float, faults: int) -> Finished:
    run_.stdout.seek(0)
    run_.stderr.seek(0)
    stdout, stderr = run_.stdout.read(), run_.stderr.read()
    run_.stdout.close()
    run_.stderr.close()
    if run_.process.returncode != 0:
        sys.exit(f"benchmark run failed: {' '.join(run_.command)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return Finished(stdout, wall_s, faults)


def run(command: list[str], project: Path) -> Finished:
    return wait_all([start(command, project)])[0]


def generated_command(nproc: int, out: Path, workload: list[str], extra=()) -> list[str]:
    """The command of a generated run into `out`, which this empties (no resume)."""
    shutil.rmtree(out, ignore_errors=True)
    return [*launcher(nproc), "train.py", *workload, *extra, f"output_dir={out}"]


def generated_result(out: Path, finished: Finished) -> dict:
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    inside = sum(e["train_time_s"] + e["outside_train_s"] for e in epochs)
    return {
        "step_s": statistics.median(e["step_time_median_s"] for e in epochs),
        "samples_per_s": statistics.mean(e["samples_per_s"] for e in epochs),
        "startup_teardown_s": finished.wall_s - inside,
        "outside_per_epoch_s": statistics.mean(e["outside_train_s"] for e in epochs),
        "rss_peak_mib": [row["rss_peak_mib"] for row in epochs[-1]["memory"]],
        "faults": finished.faults,
        "weights": torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"],
    }


def handwritten_command(nproc: int, out: Path, workload: list[str]) -> list[str]:
    """The command of a hand-written run writing its weights into `out`, which this creates."""
    out.mkdir(parents=True, exist_ok=True)
    return [*launcher(nproc), str(HANDWRITTEN), json.dumps(workload), str(out / "handwritten.pt")]


def handwritten_result(out: Path, finished: Finished) -> dict:
    lines = (line for line in finished.stdout.splitlines() if line.startswith("{"))
    ranks = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    return {
        "step_s": ranks[0]["step_time_median_s"],
        "samples_per_s": ranks[0]["samples_per_s"],
        "startup_teardown_s": finished.wall_s - ranks[0]["train_time_s"],
        "outside_per_epoch_s": 0.0,
        "rss_peak_mib": [r["rss_peak_mib"] for r in ranks],
        "faults": finished.faults,
        "weights": torch.load(out / "handwritten.pt", map_location="cpu", weights_only=True),
    }


def run_generated(project: Path, nproc: int, out: Path, workload: list[str], extra=()) -> dict:
    return generated_result(out, run(generated_command(nproc, out, workload, extra), project))


def run_handwritten(project: Path, nproc: int, out: Path, workload: list[str]) -> dict:
    return handwritten_result(out, run(handwritten_command(nproc, out, workload), project))


def run_side_by_side(project: Path, work: Path, workload: list[str], pair: int, cores: list[int]):
    """One process of each loop at the same time, each on its own core: both see the same
    machine, whatever else it is doing then. The cores swap every pair and which loop
    starts first every two pairs, so neither a core nor a head start favours one loop."""
    a_out, b_out = work / "a1", work / "b1"
    commands = {"a": generated_command(1, a_out, workload), "b": handwritten_command(1, b_out, workload)}
    core = {"a": cores[pair % 2], "b": cores[1 - pair % 2]}
    order = ["b", "a"] if pair // 2 % 2 else ["a", "b"]
    finished = dict(zip(order, wait_all([start(commands[loop], project, core[loop]) for loop in order]), strict=True))
    return generated_result(a_out, finished["a"]), handwritten_result(b_out, finished["b"])


def alternating(project: Path, work: Path, workload: list[str], nproc: int, swap: bool) -> tuple[dict, dict]:
    """One run of each loop after the other, the order swapped between pairs to cancel drift."""
    results = {}
    for loop in ("b", "a") if swap else ("a", "b"):
        runner = run_generated if loop == "a" else run_handwritten
        results[loop] = runner(project, nproc, work / f"{loop}{nproc}", workload)
    return results["a"], results["b"]


def same_weights(a: dict, b: dict) -> str:
    if a.keys() != b.keys():
        return "different keys"
    if all(torch.equal(a[k], b[k]) for k in a):
        return "bitwise equal"
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    return f"max abs difference {worst:.2e}"


def compare_loops(project: Path, work: Path, repeats: int, case: str) -> None:
    title, workload, nprocs = CASES[case]
    print(f"\n== {title}: generated loop (a) vs hand-written loop (b), {repeats} pairs of runs")
    print("   workload: " + " ".join(workload))
    print(
        "   1 process: a and b run side by side, one core each (cores and start order swapped between pairs), so "
        "each pair shares the machine's state;\n"
        "   more processes: a and b run one after the other, the order swapped between pairs"
    )
    print("   step ms: median over runs of each run's median step (spread: min-max over runs)")
    print(
        f"{'procs':>5} {'loop':>4} {'step ms':>8} {'spread':>13} {'samples/s':>10} {'faults':>9} {'start+end s':>11} "
        f"{'outside/epoch s':>15}  peak RSS MiB per rank"
    )
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    for nproc in nprocs:
        results = {"a": [], "b": []}
        for repeat in range(repeats):
            if nproc == 1 and len(cores) == 2:
                a, b = run_side_by_side(project, work, workload, repeat, cores)
            else:
                a, b = alternating(project, work, workload, nproc, swap=repeat % 2 == 1)
            results["a"].append(a)
            results["b"].append(b)
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
    """The a/b step-time ratio of each pair (the two runs of a pair share the machine's
    state at the time), their median and spread, and what that spread allows one to say."""
    pairs = sorted(a["step_s"] / b["step_s"] for a, b in zip(results["a"], results["b"], strict=True))
    if pairs[0] <= 1.0 <= pairs[-1]:
        verdict = "the spread overlaps 1.0: no lead either way"
    else:
        verdict = "generated faster" if pairs[-1] < 1.0 else "generated slower"
    weights = same_weights(results["a"][-1]["weights"], results["b"][-1]["weights"])
    return (
        f"a/b step-time ratio {statistics.median(pairs):.3f}, median of {len(pairs)} pairs "
        f"(spread {pairs[0]:.3f}-{pairs[-1]:.3f}: {', '.join(f'{p:.3f}' for p in pairs)}); {verdict}; "
        f"final weights: {weights}"
    )


MEMORY_WORKLOAD = [
    "data.image_size=32",
    "data.train_size=128",
    "data.val_size=16",
    "train.num_workers=0",
    "optim.name=adamw",
    "train.batch_size=8",
    "train.epochs=1",
]
MEMORY_LAYOUTS = [(1, "ddp"), (2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp")]


def compare_memory(project: Path, work: Path) -> None:
    """Peak RSS per rank in each phase (benchmarks/memory_phases.py), DDP vs FSDP."""
    print(
        "\n== peak RSS per rank, MiB: a 101M-parameter MLP of 24 blocks, AdamW (rank 0 / the largest of the "
        "others); the runtime (torch, the process group) is about 680 of each"
    )
    print("| strategy | processes | setup | training steps | save | weights + optimizer held | save time |")
    print("|---|---|---|---|---|---|---|")
    script = str(Path(__file__).with_name("memory_phases.py"))
    for nproc, strategy in MEMORY_LAYOUTS:
        out = work / f"memory-{strategy}-{nproc}"
        args = [*MEMORY_WORKLOAD, f"fsdp.enabled={strategy == 'fsdp'}", f"output_dir={out}"]
        run([*launcher(nproc), script, str(out / "phases.json"), *args], project)
        rows = [json.loads((out / f"phases.json.{rank}").read_text()) for rank in range(nproc)]

        def cell(key: str, rows=rows) -> str:
            others = f" / {max(row[key] for row in rows[1:]):,.0f}" if len(rows) > 1 else ""
            return f"{rows[0][key]:,.0f}{others}"

        held = rows[0]["params_mib"] + rows[0]["optimizer_mib"]
        save = f"{rows[0]['save_s']:.2f} s"
        if "async_blocked_s" in rows[0]:
            blocked, done = max(r["async_blocked_s"] for r in rows), max(r["async_done_s"] for r in rows)
            save += f" (async: {blocked:.2f} s blocked, written after {done:.2f} s)"
        print(
            f"| {strategy} | {nproc} | {cell('setup_peak_mib')} | {cell('step_peak_mib')} | "
            f"{cell('save_peak_mib')} | {held:,.0f} | {save} |"
        )


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


# Every part's answer "no": the lean bake.
LEAN = dict.fromkeys(json.loads((TEMPLATE / "manifest.json").read_text())["parts"], "no")
QUICK = ["model.name=mlp", "model.hidden_dim=256", "data.train_size=1024", "train.num_workers=0"]
QUICK += ["train.batch_size=32", "train.epochs=1", "train.log_every_steps=100000", "checkpoint.resume=none"]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(TEMPLATE), *args], capture_output=True, text=True, check=True).stdout


def previous_version(work: Path) -> tuple[str, Path] | None:
    """The template as the commit that set the previous _template_version left it, in a folder
    of `work`; None where this checkout has no history (a shallow clone, an archive)."""
    current = json.loads((TEMPLATE / "cookiecutter.json").read_text())["_template_version"]
    try:
        for commit in git("log", "--format=%H", "-G_template_version", "--", "cookiecutter.json").split():
            version = json.loads(git("show", f"{commit}:cookiecutter.json"))["_template_version"]
            if version != current:
                folder = work / f"template-{version}"
                folder.mkdir()
                archive = subprocess.run(
                    ["git", "-C", str(TEMPLATE), "archive", commit], capture_output=True, check=True
                )
                tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(folder, filter="data")
                return version, folder
    except (OSError, subprocess.CalledProcessError):
        pass
    return None


def training_samples_per_s(out: Path | None, finished: Finished) -> float:
    """Samples per second while training: the generated run's metrics rows (`out`), or the
    hand-written loop's line."""
    if out is None:
        return json.loads(next(line for line in finished.stdout.splitlines() if line.startswith("{")))["samples_per_s"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.mean(row["samples_per_s"] for row in rows)


def time_per_sample_ratios(now: Path, other: Path | None, work: Path, workload: list[str], repeats: int) -> list[float]:
    """This version's time per training sample over the other's (a baked project; None: the
    hand-written loop in `now`), one ratio per pair of runs side by side on a core each,
    cores and start order swapped between pairs; 1 process each."""
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    ratios = []
    for pair in range(repeats):
        outs = (work / "now", None if other is None else work / "other")
        commands = [
            (generated_command(1, outs[0], workload), now),
            (handwritten_command(1, work / "plain", workload), now)
            if other is None
            else (generated_command(1, outs[1], workload), other),
        ]
        order = [1, 0] if pair % 2 else [0, 1]
        pinned = [cores[(i + pair) % 2] if len(cores) == 2 else None for i in range(2)]
        started = [start(commands[i][0], commands[i][1], pinned[i]) for i in order]
        finished = dict(zip(order, wait_all(started), strict=True))
        mine, theirs = (training_samples_per_s(outs[i], finished[i]) for i in (0, 1))
        ratios.append(theirs / mine)
    return sorted(ratios)


def baked(template: Path, out: Path, answers: dict) -> Path:
    """A project baked in a process of its own: each template imports its own local_extensions."""
    command = [sys.executable, "-m", "cookiecutter", str(template), "--no-input", "-o", str(out)]
    answers = [f"{key}={value}" for key, value in answers.items()]
    subprocess.run([*command, *answers], cwd=template, capture_output=True, check=True)  # its extensions, not ours
    return next(out.iterdir())


def compare_versions(work: Path, repeats: int, workloads: dict[str, list[str]], bakes=("default", "lean")) -> None:
    """The generated step against a plain loop over the same files, and against the previous
    version's bake, for the default and the lean bake: ratios of time per training sample."""
    previous = previous_version(work)
    print(
        f"\n== time per training sample, ratio of this version's to the other's, {repeats} pairs of runs side by "
        "side (median, spread min-max); below 1.0: this version is faster"
    )
    if previous is None:
        print("   (no previous version: this checkout has no git history)")
    for bake_name, answers in {"default": {}, "lean": LEAN}.items():
        if bake_name not in bakes:
            continue
        now = baked(TEMPLATE, work / f"now-{bake_name}", answers)
        before = previous and baked(previous[1], work / f"before-{bake_name}", answers)
        for name, workload in workloads.items():
            against = {"plain loop": None} | ({previous[0]: before} if before else {})
            for other_name, other in against.items():
                ratios = time_per_sample_ratios(now, other, work, workload, repeats)
                spread = f"{ratios[0]:.3f}-{ratios[-1]:.3f}"
                print(
                    f"   {bake_name} bake, {name}: vs {other_name}: {statistics.median(ratios):.3f} (spread {spread}: "
                    f"{', '.join(f'{r:.3f}' for r in ratios)})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeats", type=int, default=8, help="pairs of runs per row (a multiple of 4 balances cores and start order)"
    )
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES), help="none: memory only")
    parser.add_argument("--switches", action="store_true", help="also time each speed switch")
    parser.add_argument("--quick", action="store_true", help="the versions' comparison only, short (the template's CI)")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}; "
        f"torch {torch.__version__}, Python {platform.python_version()}; CPU processes, gloo"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.quick:
            compare_versions(work, 2, {"MLP, 1,024 samples": QUICK}, bakes=("default",))
            return
        compare_versions(work, args.repeats, {"MLP (small steps)": SMALL_STEPS, "ResNet-18": RESNET})
        fsdp = {"fsdp": "yes"}  # for the memory table's FSDP rows; the default answers leave it out
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(work / "bake"), extra_context=fsdp))
        for case in args.cases:
            compare_loops(project, work, args.repeats, case)
        compare_memory(project, work)
        if args.switches:
            compare_switches(project, work)


if __name__ == "__main__":
    main()
