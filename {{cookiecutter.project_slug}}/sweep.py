"""Run a grid of settings: one run per combination, one after another, then a table.

  python sweep.py optim.lr=0.05,0.1 model.name=mlp,resnet18          4 runs, one process each
  python sweep.py --nproc 2 optim.lr=0.05,0.1 train.epochs=5          2 runs, each under torchrun
  python sweep.py --out runs/lr optim.lr=0.02,0.05,0.1                 their output_dirs in runs/lr

A key with several values (comma-separated; a list value keeps its brackets:
model.widths=[32,64],[64,128]) is swept; a key with one value applies to every run. Each
run's output_dir is --out/<its swept settings>, e.g. runs/sweep/optim.lr=0.05,model.name=mlp,
and it is an ordinary run: resumable and locked as any. The same command again continues
the runs that did not finish and passes over those that did. The table at the end gives
each run's best checkpoint.best_metric, and the exit code is 1 if a run failed.

As a SLURM job array, one combination per array task (each requeued and resumed alone):

  python sweep.py --list optim.lr=0.05,0.1 model.name=mlp,resnet18                 the 4 runs, numbered 0-3
  sbatch --array=0-3 scripts/slurm/train.sbatch optim.lr=0.05,0.1 model.name=mlp,resnet18
  python sweep.py --table optim.lr=0.05,0.1 model.name=mlp,resnet18                their table, as they are

(the sbatch script asks `python sweep.py --print-run $SLURM_ARRAY_TASK_ID ...` for its
task's train.py arguments; `sacct -j JOB` tells how each task ended).
"""

import argparse
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parent / "train.py"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/sweep", help="the folder of the runs' output_dirs (default: runs/sweep)")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun when more than 1)")
    parser.add_argument("--config", default="config.yaml", help="YAML config of every run (default: config.yaml)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--list", action="store_true", help="print the runs, numbered from 0, and run none")
    only.add_argument("--table", action="store_true", help="print the runs' table as they are, and run none")
    only.add_argument("--print-run", type=int, metavar="K", help="print run K's train.py arguments, one a line")
    parser.add_argument("settings", nargs="+", metavar="section.key=v1,v2", help="e.g. optim.lr=0.05,0.1")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        grid = parse_grid(args.settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    runs = plan(grid, Path(args.out))
    if args.print_run is not None:
        if not 0 <= args.print_run < len(runs):
            print(f"error: no run {args.print_run}: the grid has runs 0 to {len(runs) - 1}", file=sys.stderr)
            return 2
        print("\n".join(train_args(args, *runs[args.print_run])), flush=True)
        return 0
    if args.list or args.table:
        shown = [f"{number}  {output_dir}" for number, (_, output_dir) in enumerate(runs)]
        print("\n".join(shown) if args.list else table([(output_dir, None) for _, output_dir in runs]), flush=True)
        return 0
    results = []
    for number, (settings, output_dir) in enumerate(runs, 1):
        print(f"sweep: run {number} of {len(runs)}: {output_dir}", flush=True)
        code = subprocess.call(command(args, settings, output_dir))
        results.append((output_dir, code))
    print(table(results), flush=True)
    return int(any(code != 0 for _, code in results))


def plan(grid: dict[str, list[str]], out: Path) -> list[tuple[dict, Path]]:
    """Every combination of the grid's values, with its output_dir: out/<its swept settings>."""
    swept = [key for key, values in grid.items() if len(values) > 1]
    runs = []
    for values in itertools.product(*grid.values()):
        settings = dict(zip(grid, values, strict=True))
        runs.append((settings, out / (",".join(f"{key}={settings[key]}" for key in swept) or "run").replace("/", "_")))
    return runs


def parse_grid(settings: list[str]) -> dict[str, list[str]]:
    """{key: its values}, in the order given; values split at commas outside brackets and quotes."""
    grid = {}
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"{setting!r} is not of the form section.key=value1,value2")
        if key in grid:
            raise ValueError(f"{key} is given twice; give all its values in one setting")
        grid[key] = re.findall(r"(?:\[[^\]]*\]|\{[^}]*\}|\"[^\"]*\"|'[^']*'|[^,])+", raw)
    return grid


def command(args: argparse.Namespace, settings: dict, output_dir: Path) -> list[str]:
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    return [*launcher, str(SCRIPT), *train_args(args, settings, output_dir)]


def train_args(args: argparse.Namespace, settings: dict, output_dir: Path) -> list[str]:
    overrides = [f"{key}={value}" for key, value in settings.items()]
    return ["--config", args.config, *overrides, f"output_dir={output_dir}"]


def table(results: list[tuple[Path, int | None]]) -> str:
    """A row per run: its best checkpoint.best_metric (from its config.yaml and
    metrics.jsonl), the step it was reached at, and how the run ended (its exit code; None:
    not run by this command, so "-", or "not started" if it has no output yet)."""
    rows = [("run", "best", "at step", "ended")]
    for output_dir, code in results:
        best = best_row(output_dir)
        shown = ("-", "-") if best is None else (f"{best[0]} {best[1]:.4g}", str(best[2]))
        ended = "ok" if code == 0 else f"exit {code}" if code is not None else "-"
        rows.append((output_dir.name, *shown, ended if output_dir.is_dir() else "not started"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def best_row(output_dir: Path) -> tuple[str, float, int] | None:
    """(metric, its best value, its step), or None before the run's first evaluation."""
    try:
        cfg = yaml.safe_load((output_dir / "config.yaml").read_text())["checkpoint"]
        rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    name = cfg["best_metric"]
    scored = [row for row in rows if isinstance(row.get(name), (int, float))]
    if not scored:
        return None
    best = (max if cfg["best_mode"] == "max" else min)(scored, key=lambda row: row[name])
    return name, best[name], best["step"]


if __name__ == "__main__":
    sys.exit(main())
