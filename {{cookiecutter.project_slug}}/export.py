"""Export a checkpoint's model weights as one plain file, for inference.

  python export.py --checkpoint runs/default/checkpoints/best.pt --out model.pt

{% if cookiecutter.fsdp %}Takes either kind of checkpoint: a .pt file, or the folder an FSDP run saves. It runs in
one process and holds the whole model in host memory (never the optimizer state of a
folder, which it does not read); started under torchrun, rank 0 alone writes. Load the
result into the model you train:{% else %}It runs in one process and holds the whole model in host memory; started under torchrun,
rank 0 alone writes. Load the result into the model you train:{% endif %}

  model = build_model(cfg)
  model.load_state_dict(torch.load("model.pt", weights_only=True))
"""

import argparse
from pathlib import Path

import torch

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
    if out.exists():  # it may be a checkpoint: never overwrite one
        raise UsageError(f"{str(out)!r} already exists; choose another --out or remove it first")
    weights = load_model_state(args.checkpoint)
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out.parent, out.name, lambda f: torch.save(weights, f))
    except OSError as error:  # a file in the way, a read-only or full disk: nothing is left behind
        reason = f"{error.filename!r} is a file" if isinstance(error, FileExistsError) else error.strerror
        raise UsageError(
            f"cannot write {str(out)!r}: {reason or error}; choose an --out in a writable folder "
            f"with room for {size / 2**20:.{1 if size >= 2**20 else 3}f} MiB"
        ) from None
    print(f"wrote {out}: {len(weights)} tensors, {size / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
