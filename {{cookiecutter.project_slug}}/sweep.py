"""Run a grid of settings: one run per combination, one after another, then a table.

  python sweep.py optim.lr=0.05,0.1 model.name=mlp,resnet18          4 runs, one process each
  python sweep.py --nproc 2 optim.lr=0.05,0.1 train.epochs=5          2 runs, each on 2 processes
  python sweep.py --out runs/lr optim.lr=0.02,0.05,0.1                 their output_dirs in runs/lr

A key with several values (comma-separated; a list value keeps its brackets:
model.widths=[32,64],[64,128]; quotes keep a comma in a value and are not part of it:
data.name='a,b',c) is swept; a key with one value applies to every run. Each run's
output_dir is --out/<its swept settings>, e.g. runs/sweep/optim.lr=0.05,model.name=mlp
(a value's `/`, `%`, `,` and `=` written %2F, %25, %2C and %3D), and it is an ordinary run: resumable and
locked as any. The same command again continues the runs that did not finish and passes
over those that did. The table at the end gives each run's best checkpoint.best_metric.

Ctrl-C, SIGTERM or SIGUSR1 stop the run in progress as they stop train.py (with a
checkpoint; a second Ctrl-C: at once), and start no other; if this process is killed,
its run gets SIGTERM. Exit code: 0 all ran to their end, 1 a run failed, 75 stopped: run
the same command to continue.

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
import os
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
SCRIPT = ROOT / "train.py"
# The stop signals torchrun passes on to its processes: by default not SIGUSR1, which would
# end torchrun at once, its processes left to stop on their own.
TORCHRUN_PASSES_ON = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# A value: up to a comma outside brackets, braces and quotes.
VALUE = re.compile(r"(?:\[[^\]]*\]|\{[^}]*\}|\"[^\"]*\"|'[^']*'|[^,])+")


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
        runs = plan(parse_grid(args.settings), Path(args.out))
        check_folders(runs)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
    return run_all(args, runs)


def run_all(args: argparse.Namespace, runs: list[tuple[dict, Path]]) -> int:
    """Each run in turn, supervised (engine/supervisor.py): a stop signal stops the run in
    progress with its checkpoint, and no other starts. The sweep's exit code: 75 after a
    stop, 1 if a run failed, else 0."""
    from engine.lifecycle import STOPPED_EXIT_CODE  # they import torch: only when runs start
    from engine.supervisor import Supervisor

    ended = {}
    with Supervisor() as supervisor:
        for number, (settings, output_dir) in enumerate(runs, 1):
            if supervisor.stop_signal:
                break
            print(f"sweep: run {number} of {len(runs)}: {output_dir}", flush=True)
            ended[output_dir] = supervisor.run(command(args, settings, output_dir), child_env())
            if ended[output_dir] == "stopped":
                by = f" by {supervisor.stop_signal}" if supervisor.stop_signal else ""
                print(f"sweep: run {number} of {len(runs)} stopped{by}; run the same command to continue", flush=True)
                break
        print(table([(output_dir, ended.get(output_dir)) for _, output_dir in runs]), flush=True)
    if supervisor.stop_signal or "stopped" in ended.values():
        return STOPPED_EXIT_CODE
    return int(any(result != "ok" for result in ended.values()))


def parse_grid(settings: list[str]) -> dict[str, list[str]]:
    """{key: its values}, in the order given; values split at commas outside brackets and
    quotes, a quoted value without its quotes."""
    grid = {}
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"{setting!r} is not of the form section.key=value1,value2")
        if key == "output_dir":
            raise ValueError("output_dir is each run's own folder under --out; set that folder with --out")
        if key in grid:
            raise ValueError(f"{key} is given twice; give all its values in one setting")
        values = VALUE.findall(raw)
        if ",".join(values) != raw:  # a comma at an end, or two in a row
            raise ValueError(
                f"{setting!r} has an empty value; give one between every two commas, e.g. optim.lr=0.05,0.1"
            )
        grid[key] = [unquoted(value) for value in values]
    return grid


def unquoted(value: str) -> str:
    """The text inside quotes around the whole value: train.py reads a value as text (but
    a list's or a mapping's), so its quotes would become part of a string."""
    quoted = re.fullmatch(r"'([^']*)'|\"([^\"]*)\"", value)
    return value if quoted is None else next(text for text in quoted.groups() if text is not None)


def plan(grid: dict[str, list[str]], out: Path) -> list[tuple[dict, Path]]:
    """Every combination of the grid's values, with its output_dir: out/<its swept settings>."""
    swept = [key for key, values in grid.items() if len(values) > 1]
    runs = []
    for values in itertools.product(*grid.values()):
        settings = dict(zip(grid, values, strict=True))
        name = ",".join(f"{key}={folder_name_part(settings[key])}" for key in swept) or "run"
        runs.append((settings, out / name))
    return runs


def folder_name_part(value: str) -> str:
    """The value as a folder's name holds it: `%`, `/`, control characters and the name's
    own separators `,` and `=` percent-encoded (%25, %2F, %2C, %3D, ...), so that no two
    values share a name and a name splits back into its settings (urllib.parse.unquote
    gives each value back)."""
    return re.sub(r"[%/,=\x00-\x1f\x7f]", lambda found: f"%{ord(found.group()):02X}", value)


def check_folders(runs: list[tuple[dict, Path]]) -> None:
    """Each run has a folder of its own, with a name its file system can hold."""
    if not runs:
        return
    out = runs[0][1].parent
    existing = next(folder for folder in (out, *out.parents) if os.path.isdir(folder))
    limit = os.pathconf(existing, "PC_NAME_MAX")
    numbers = {}
    for number, (_, output_dir) in enumerate(runs):
        size = len(os.fsencode(output_dir.name))
        if size > limit:
            raise ValueError(
                f"run {number}'s folder name {output_dir.name!r} is {size} bytes, more than the {limit} a name "
                f"may have on the file system of {existing}; sweep shorter values"
            )
        if output_dir in numbers:
            raise ValueError(
                f"runs {numbers[output_dir]} and {number} would share the folder {output_dir}; "
                "give each value once (quotes are not part of a value)"
            )
        numbers[output_dir] = number


def command(args: argparse.Namespace, settings: dict, output_dir: Path) -> list[str]:
    launcher = [sys.executable]
    if args.nproc > 1:  # torchrun; where the project has engine/launch.py, ending in the run's own last line
        module = "engine.launch" if (ROOT / "engine" / "launch.py").is_file() else "torch.distributed.run"
        launcher += ["-m", module, "--standalone", f"--nproc_per_node={args.nproc}", TORCHRUN_PASSES_ON]
    return [*launcher, str(SCRIPT), *train_args(args, settings, output_dir)]


def child_env() -> dict:
    """This environment, with this folder first on PYTHONPATH: `python -m engine...` from any folder."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def train_args(args: argparse.Namespace, settings: dict, output_dir: Path) -> list[str]:
    overrides = [f"{key}={value}" for key, value in settings.items()]
    return ["--config", args.config, *overrides, f"output_dir={output_dir}"]


def table(results: list[tuple[Path, str | None]]) -> str:
    """A row per run: its best checkpoint.best_metric (from its config.yaml and
    metrics.jsonl), the step it was reached at, and how the run ended ("ok", "stopped",
    "exit N"; None: not run by this command, so "-", or "not started" without output yet)."""
    rows = [("run", "best", "at step", "ended")]
    for output_dir, ended in results:
        best = best_row(output_dir)
        shown = ("-", "-") if best is None else (f"{best[0]} {best[1]:.4g}", str(best[2]))
        # os.path.isdir: False, not an error, for a folder it cannot look at (a name too long)
        rows.append((output_dir.name, *shown, ended or ("-" if os.path.isdir(output_dir) else "not started")))
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
