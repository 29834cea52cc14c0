"""Run a trained model on new inputs: one JSON line per input, in the inputs' order.

  python predict.py --checkpoint runs/default/checkpoints/best.pt --inputs photos/ --out predictions.jsonl
  torchrun --nproc_per_node=4 predict.py --checkpoint export/model.safetensors --inputs photos/ --out predictions.jsonl

--checkpoint: a training checkpoint (a .pt file, or a sharded checkpoint's folder: the fsdp part), or a
file of weights export.py wrote (model.pt or model.safetensors) with its model.yaml
beside it. Not export's program, model.pt2: loading one runs Python that torch makes from
the file, so a hostile one runs code; its weights are in model.safetensors beside it.
--inputs: what data.py's `build_predict_set` reads (this example: a folder of images),
pre-processed as validation samples are; model.py's `predict_step` makes each input's
result. Key=value overrides apply to the model's settings (e.g.
train.eval_batch_size=64 train.num_workers=8).

Each process holds the whole model and predicts whole batches, dealt as evaluation deals
them, into its file in a hidden folder of this run's own beside --out; rank 0 then joins
them in input order (on several nodes, --out's folder must be one they all see). A batch
holds the same inputs on any number of processes, so the file is the same, to the bit, on
any number. --out is created, never replaced: if it appears meanwhile (another run's),
this run stops in one line. A file a user hands in is read as data: nothing in it runs
(docs/checkpoints.md).
"""

import argparse
import json
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import data
import model as task
from data import DataConfig
from engine.checkpoint import load_checkpoint, load_exported_weights, load_model_state, load_model_weights
from engine.config import load_config
from engine.distributed import (
    broadcast_from_main,
    cleanup_distributed,
    init_distributed_mode,
    is_main,
    stop_all_if_any_fails,
)
from engine.errors import TaskError, UsageError
from engine.files import already_exists, not_written, open_new, private_folder, write_new_file
from engine.lifecycle import leave_stop_signals_to_the_rank
from engine.loader import build_val_loader, move_to_device
from engine.logs import report_errors
from engine.training import autocast
from model import ModelConfig, build_model
from recipe import OptimConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint, or export.py's .pt or .safetensors")
    parser.add_argument("--inputs", required=True, help="the new inputs, as data.py's build_predict_set reads them")
    parser.add_argument("--out", required=True, help="the JSON-lines file to write (must not exist yet)")
    parser.add_argument("--config", default=None, help="YAML config (default: the one saved with the model)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


@record
@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    source, out = Path(args.checkpoint), Path(args.out)
    refuse_program(source)
    # SIGTERM (a launcher's, a scheduler's), a closed terminal's SIGHUP and Ctrl-\\ stop it as
    # Ctrl-C does: through the `finally` below, which removes this run's parts.
    for stop_signal in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(stop_signal, signal.default_int_handler)
    if os.path.lexists(out):  # it may be last week's predictions, or a link: never written through
        raise already_exists(out)
    build_predict_set, predict_step = task_hooks()
    sections = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig}
    ckpt = None if is_export(source) else load_checkpoint(source, tensors=False)  # a file's weights too
    base = ckpt.get("config") if ckpt else None
    cfg = load_config(args.config or saved_settings(source), args.overrides, base=base, **sections)
    env, device = init_distributed_mode(cfg.dist)
    parts = None  # this run's folder of the ranks' lines, joined by rank 0
    try:
        with stop_all_if_any_fails(device):
            inputs = build_predict_set(cfg, args.inputs)
            model = load_predictor(source, ckpt, cfg, device)
            parts = private_folder(out) if is_main() else None
        parts = broadcast_from_main(parts)
        check_same_inputs(len(inputs), device)
        hooks = {"collate_fn": getattr(data, "collate_fn", None), "worker_init_fn": leave_stop_signals_to_the_rank}
        with build_val_loader(inputs, cfg, env, device, **hooks) as loader:
            with stop_all_if_any_fails(device):
                predict_own_batches(model, loader, predict_step, parts / f"rank{env.rank}", device, cfg.train.precision)
            with stop_all_if_any_fails(device):  # every rank waits here until rank 0 has read the parts
                if is_main():
                    join_parts(out, parts, loader.batch_sampler, env.world_size)
        if is_main():
            print(f"wrote {out}: {len(inputs)} predictions, one JSON line per input", flush=True)
    finally:
        if parts is not None:
            (parts / f"rank{env.rank}").unlink(missing_ok=True)
            if is_main():
                shutil.rmtree(parts, ignore_errors=True)
        cleanup_distributed()


def check_same_inputs(count: int, device: torch.device) -> None:
    """Every rank listed the same number of inputs (a folder that changed while the ranks
    listed it, or differs between nodes, would misalign the joined lines). Every rank must
    call this."""
    counts = torch.tensor([count, -count], device=device)
    if dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if int(counts[0]) != -int(counts[1]):
        raise UsageError(
            f"--inputs: the processes found from {-int(counts[1])} to {int(counts[0])} inputs; every process must "
            "see the same inputs (a folder still being written, or different on each node)"
        )


def task_hooks():
    """data.py's build_predict_set and model.py's predict_step, or one line on what to add."""
    for module, name, what in (
        (data, "build_predict_set", "build_predict_set(cfg, source) returning the new inputs as a dataset"),
        (task, "predict_step", "predict_step(model, batch) returning one result per input"),
    ):
        if not callable(getattr(module, name, None)):
            raise UsageError(f"{module.__name__}.py has no {name}; add {what} (docs/task.md shows one)")
    return data.build_predict_set, task.predict_step


EXPORTED = (".safetensors",)  # export.py's weights; its .pt counts when model.yaml is beside it


def is_export(source: Path) -> bool:
    return source.suffix in EXPORTED or (source.suffix == ".pt" and source.with_suffix(".yaml").is_file())


def refuse_program(source: Path) -> None:
    """export's model.pt2 is refused unread: torch.export.load builds Python from what the
    file says and runs it (and unpickles what it marks so), so a hostile file runs code."""
    if source.suffix == ".pt2":
        raise UsageError(
            f"--checkpoint {str(source)!r} is a torch.export program, which predict.py does not load (loading one runs "
            f"code made from the file); give {source.with_suffix('.safetensors').name}, its weights, which export.py "
            "writes beside it"
        )


def saved_settings(source: Path) -> Path | None:
    """An export's model.yaml, the settings that build its model; None for a checkpoint."""
    if not source.exists():
        raise UsageError(f"--checkpoint {str(source)!r} not found")
    if not is_export(source):
        return None
    settings = source.with_suffix(".yaml")
    if not settings.is_file():
        raise UsageError(
            f"{str(settings)!r} is missing: export.py writes it beside {source.name}, with the settings that build "
            "the model; copy it there, or give --config"
        )
    return settings


def load_predictor(source: Path, ckpt: dict | None, cfg, device: torch.device) -> torch.nn.Module:
    """The model of cfg in eval mode, holding the weights of an export's file or of a
    checkpoint (`ckpt`: what load_checkpoint read of it)."""
    if ckpt is None:
        weights = load_exported_weights(source)
    else:  # a file's weights were read with its settings; a folder's are read now
        weights = ckpt["model"] if "model" in ckpt else load_model_state(source)[0]
    model = build_model(cfg)
    load_model_weights(model, weights, str(source))
    return model.to(device).eval()


def predict_own_batches(model, loader, predict_step, part: Path, device, precision: str) -> None:
    """This rank's batches' results, one JSON line each, into `part` (a new file)."""
    plan = loader.batch_sampler
    with open_new(part) as lines, torch.no_grad():
        for batch_id, batch in zip(plan.batch_ids, loader, strict=True):
            with autocast(precision, device):
                results = predict_step(model, move_to_device(batch, device))
            if not isinstance(results, list | tuple) or len(results) != plan.samples_in(batch_id):
                got = f"{len(results)} result(s)" if isinstance(results, list | tuple) else type(results).__name__
                raise TaskError(
                    f"predict_step returned {got} for a batch of {plan.samples_in(batch_id)} inputs; "
                    "return a list with one result per input"
                )
            for result in results:
                lines.write(as_json(result) + "\n")


def as_json(result) -> str:
    try:
        return json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TaskError(
            f"predict_step's result {str(result)[:80]!r} is not JSON ({error}); return finite numbers, strings, "
            "lists and dicts (a tensor's .item() or .tolist())"
        ) from None


def join_parts(out: Path, parts: Path, plan, world_size: int) -> None:
    """Rank r's part holds batches r, r + N, ...: read them back in batch order into --out,
    created (never replacing a file that appeared meanwhile)."""
    files = [open(parts / f"rank{rank}", encoding="utf-8") for rank in range(world_size)]
    try:

        def write(file) -> None:
            for batch_id in range(plan.num_batches):
                part = files[batch_id % world_size]
                for _ in range(plan.samples_in(batch_id)):
                    line = part.readline()
                    if not line.endswith("\n"):  # a part cut short: never a file of shifted lines
                        raise UsageError(f"rank {batch_id % world_size}'s predictions end early; run predict.py again")
                    file.write(line.encode())

        write_new_file(out, write)
    except OSError as error:
        raise not_written(out, error, instead="another --out") from None
    finally:
        for file in files:
            file.close()


if __name__ == "__main__":
    main()
