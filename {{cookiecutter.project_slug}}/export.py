"""Export a checkpoint's model weights, for inference, with the settings that built the model.

  python export.py --checkpoint runs/default/checkpoints/best.pt --out model.pt

writes model.pt (a torch.save state dict), model.safetensors (the same tensors, in a
format any framework reads without running code) and model.yaml (the run's settings, the
model section among them: `--config model.yaml` builds the same model). With --program it
also writes model.pt2, a torch.export program traced from one batch of the validation
set (model.py's `model_inputs` says what the model takes), its batch size left free:
it runs without this project's code.

Takes either kind of checkpoint: a .pt file, or the folder an FSDP run saves (the fsdp
part). It runs in one process and holds the whole model in host memory (never the
optimizer state of a folder, which it does not read); started under torchrun, rank 0
alone writes. Load the result into the model you train:

  model = build_model(cfg)
  model.load_state_dict(torch.load("model.pt", weights_only=True))
  # or: model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
  # or, with no model.py at all: torch.export.load("model.pt2").module()(images)
  # (load only programs you made: torch's loader runs code made from the file)

predict.py runs model.pt or model.safetensors on new inputs.
"""

import argparse
import io
import os
from pathlib import Path

import safetensors.torch
import torch
import yaml
from torch.utils.data import default_collate

import data
import model as task
from data import DataConfig, build_datasets
from engine.checkpoint import load_model_state, load_model_weights
from engine.config import ConfigDumper, load_config
from engine.distributed import is_main
from engine.errors import UsageError
from engine.files import already_exists, write_new_file
from engine.logs import report_errors
from model import ModelConfig, build_model
from recipe import OptimConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint: a .pt file, or a sharded checkpoint's folder (the fsdp part)"
    )
    parser.add_argument("--out", required=True, help="the weights file to write (must not exist yet)")
    parser.add_argument("--program", action="store_true", help="also write a torch.export program (.pt2)")
    return parser.parse_args(argv)


@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    if not is_main():  # under a launcher: one writer, the others have nothing to do
        return
    out = Path(args.out)
    files = [out, out.with_suffix(".safetensors"), out.with_suffix(".yaml")] + [out.with_suffix(".pt2")] * args.program
    if len(set(files)) < len(files):  # e.g. --out model.pt2 with --program: the program would replace the weights
        raise UsageError(f"--out {str(out)!r} is named as a file written beside it; end it in .pt, e.g. model.pt")
    for path in files:
        if os.path.lexists(path):  # it may be a checkpoint, or a link: never written through
            raise already_exists(path)
    weights, config = load_model_state(args.checkpoint)
    writers = [
        lambda f: torch.save(weights, f),
        lambda f: f.write(safetensors.torch.save(unshared(weights))),
        lambda f: f.write(yaml.dump(config, Dumper=ConfigDumper, sort_keys=False).encode()),
    ]
    if args.program:
        program = export_program(weights, config)
        writers.append(lambda f: f.write(saved_program(program)))
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    written = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, write in zip(files, writers, strict=True):
            write_new_file(path, write)  # created, never replacing a file that appeared meanwhile
            written.append(path)
    except BaseException as error:  # another run's file, a file in the way, a full disk: nothing of ours is left
        for path in written:
            path.unlink()
        if not isinstance(error, OSError):
            raise
        reason = f"{error.filename!r} is a file" if isinstance(error, FileExistsError) else error.strerror
        raise UsageError(
            f"cannot write {str(out)!r}: {reason or error}; choose an --out in a writable folder "
            f"with room for {(len(files) - 1) * size / 2**20:.{1 if size >= 2**20 else 3}f} MiB"
        ) from None
    beside = ", ".join(path.name for path in files[1:-1]) + f" and {files[-1].name}"
    print(f"wrote {out}: {len(weights)} tensors, {size / 2**20:.1f} MiB; beside it {beside}", flush=True)


def saved_program(program: torch.export.ExportedProgram) -> bytes:
    buffer = io.BytesIO()  # torch.export.save writes to a file name or a buffer
    torch.export.save(program, buffer)
    return buffer.getvalue()


def export_program(weights: dict, config: dict) -> torch.export.ExportedProgram:
    """The model in eval mode, traced by torch.export from two validation samples (a batch
    of one would fix the batch size at 1), with the batch dimension of every input free."""
    model_inputs = getattr(task, "model_inputs", None)
    if not callable(model_inputs):
        raise UsageError("--program: model.py has no model_inputs(batch); add one returning what model(...) takes")
    cfg = load_config(None, base=config, data=DataConfig, model=ModelConfig, optim=OptimConfig)
    model = build_model(cfg)
    load_model_weights(model, weights, "the checkpoint")
    _, val_set = build_datasets(cfg)
    batch = (getattr(data, "collate_fn", None) or default_collate)([val_set[i % len(val_set)] for i in range(2)])
    inputs = tuple(model_inputs(batch))
    batch_size = torch.export.Dim("batch")
    shapes = tuple({0: batch_size} if isinstance(x, torch.Tensor) else None for x in inputs)
    try:
        return torch.export.export(model.eval(), inputs, dynamic_shapes=shapes)
    except Exception as error:  # noqa: BLE001  torch.export's reasons are many and long
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"--program: torch.export cannot trace the model ({reason[:300]}); export without --program, "
            "or make the model traceable (https://pytorch.org/docs/stable/export.html)"
        ) from None


def unshared(weights: dict) -> dict:
    """The tensors, contiguous, each with memory of its own (tied weights share theirs),
    as safetensors stores them."""
    seen, own = set(), {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        own[name] = tensor.contiguous() if storage not in seen else tensor.clone()
        seen.add(storage)
    return own


if __name__ == "__main__":
    main()
