"""Evaluate a checkpoint on the validation set; prints one JSON line on rank 0.

  python evaluate.py --checkpoint runs/default/checkpoints/best.pt
  torchrun --nproc_per_node=4 evaluate.py --checkpoint PATH [--config FILE] [section.key=value ...]

The model and data settings come from the checkpoint's own config unless --config is
given; key=value overrides apply on top (e.g. data.num_workers=0).
"""

import argparse
import json

from torch.distributed.elastic.multiprocessing.errors import record

from checkpoint import load_checkpoint, load_model_weights
from config import load_config
from data import build_datasets, prepare_data
from distributed import cleanup_distributed, init_distributed_mode, is_main, run_everywhere, run_on_node_leaders
from engine import evaluate
from loader import build_val_loader, with_num_classes
from logs import report_errors
from model import build_model


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint file (.pt)")
    parser.add_argument("--config", default=None, help="YAML config (default: the checkpoint's)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


@record
@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    ckpt = load_checkpoint(args.checkpoint)
    cfg = load_config(args.config, args.overrides, base=ckpt.get("config"))
    env, device = init_distributed_mode(cfg.dist)
    try:
        run_on_node_leaders(lambda: prepare_data(cfg), env, device)  # one writer per node at a time
        train_set, val_set = run_everywhere(lambda: build_datasets(cfg), device)
        cfg = with_num_classes(cfg, train_set)
        model = build_model(cfg)
        load_model_weights(model, ckpt["model"], args.checkpoint)
        model.to(device)
        metrics = evaluate(model, build_val_loader(val_set, cfg, env, device), device, cfg.train.precision)
        if is_main():
            print(json.dumps({"checkpoint": args.checkpoint, "step": ckpt.get("step"), **metrics}), flush=True)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
