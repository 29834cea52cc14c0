"""Export a checkpoint's model weights, for inference, with the settings that built the model.

  python export.py --checkpoint runs/default/checkpoints/best.pt --out model.pt

writes model.pt (a torch.save state dict), model.safetensors (the same tensors, in a
format any framework reads without running code) and model.yaml (the run's settings, the
model section among them: `--config model.yaml` builds the same model).

{% if cookiecutter.fsdp %}Takes either kind of checkpoint: a .pt file, or the folder an FSDP run saves. It runs in
one process and holds the whole model in host memory (never the optimizer state of a
folder, which it does not read); started under torchrun, rank 0 alone writes. Load the
result into the model you train:{% else %}It runs in one process and holds the whole model in host memory; started under torchrun,
rank 0 alone writes. Load the result into the model you train:{% endif %}

  model = build_model(cfg)
  model.load_state_dict(torch.load("model.pt", weights_only=True))
  # or: model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
"""

import argparse
from pathlib import Path

import safetensors.torch
import torch
import yaml

from engine.checkpoint import atomic_write, load_model_state
from engine.distributed import is_main
from engine.errors import UsageError
from engine.logs import report_errors


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint: a .pt file{% if cookiecutter.fsdp %}, or a sharded checkpoint's folder{% endif %}")
    parser.add_argument("--out", required=True, help="the weights file to write (must not exist yet)")
    return parser.parse_args(argv)


@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    if not is_main():  # under a launcher: one writer, the others have nothing to do
        return
    out = Path(args.out)
    files = [out, out.with_suffix(".safetensors"), out.with_suffix(".yaml")]
    for path in files:
        if path.exists():  # it may be a checkpoint: never overwrite one
            raise UsageError(f"{str(path)!r} already exists; choose another --out or remove it first")
    weights, config = load_model_state(args.checkpoint)
    writers = [
        lambda f: torch.save(weights, f),
        lambda f: f.write(safetensors.torch.save(unshared(weights))),
        lambda f: f.write(yaml.safe_dump(config, sort_keys=False).encode()),
    ]
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    written = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, write in zip(files, writers, strict=True):
            atomic_write(out.parent, path.name, write)
            written.append(path)
    except OSError as error:  # a file in the way, a read-only or full disk: nothing is left behind
        for path in written:
            path.unlink()
        reason = f"{error.filename!r} is a file" if isinstance(error, FileExistsError) else error.strerror
        raise UsageError(
            f"cannot write {str(out)!r}: {reason or error}; choose an --out in a writable folder "
            f"with room for {2 * size / 2**20:.{1 if size >= 2**20 else 3}f} MiB"
        ) from None
    print(
        f"wrote {out}: {len(weights)} tensors, {size / 2**20:.1f} MiB; beside it {files[1].name} and {files[2].name}",
        flush=True,
    )


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
