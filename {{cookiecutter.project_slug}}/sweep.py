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
    parser.add_argument("settings", nargs="+", metavar="section.key=v1,v2", help="e.g. optim.lr=0.05,0.1")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        grid = parse_grid(args.settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    runs = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    swept = [key for key, values in grid.items() if len(values) > 1]
    results = []
    for number, settings in enumerate(runs, 1):
        output_dir = Path(args.out) / (",".join(f"{key}={settings[key]}" for key in swept) or "run").replace("/", "_")
        print(f"sweep: run {number} of {len(runs)}: {output_dir}", flush=True)
        code = subprocess.call(command(args, settings, output_dir))
        results.append((output_dir, code))
    print(table(results), flush=True)
    return int(any(code != 0 for _, code in results))


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
    overrides = [f"{key}={value}" for key, value in settings.items()]
    return [*launcher, str(SCRIPT), "--config", args.config, *overrides, f"output_dir={output_dir}"]


def table(results: list[tuple[Path, int]]) -> str:
    """A row per run: its best checkpoint.best_metric (from its config.yaml and
    metrics.jsonl), the step it was reached at, and how the run ended."""
    rows = [("run", "best", "at step", "ended")]
    for output_dir, code in results:
        best = best_row(output_dir)
        shown = ("-", "-") if best is None else (f"{best[0]} {best[1]:.4g}", str(best[2]))
        rows.append((output_dir.name, *shown, "ok" if code == 0 else f"exit {code}"))
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
