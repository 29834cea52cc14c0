"""Evaluate a checkpoint on the validation set; prints one JSON line on rank 0.

  python evaluate.py --checkpoint runs/default/checkpoints/best.pt
  torchrun --nproc_per_node=4 evaluate.py --checkpoint PATH [--config FILE] [section.key=value ...]
  python evaluate.py --checkpoint PATH --weights NAME     a part's set of weights, saved beside the model's

The model and data settings come from the checkpoint's own config unless --config is
given; key=value overrides apply on top (e.g. train.num_workers=0).
"""

import argparse
import json
import os
from functools import partial
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

import data
from data import DataConfig, build_datasets, prepare_data
from engine.checkpoint import load_checkpoint, load_weights
from engine.config import load_config
from engine.distributed import (
    cleanup_distributed,
    init_distributed_mode,
    is_main,
    parse_dist_env,
    prepare_on_node_leaders,
    stop_all_if_any_fails,
)
from engine.hooks import build_parts
from engine.lifecycle import leave_stop_signals_to_the_rank
from engine.loader import build_val_loader
from engine.logs import report_errors
from engine.metrics import evaluate
from engine.parallel import build_for_evaluation
from model import BLOCKS, ModelConfig, build_metrics, build_model, validation_step
from recipe import OptimConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint: a .pt file, or a part's folder (sharded)")
    parser.add_argument("--config", default=None, help="YAML config (default: the checkpoint's)")
    parser.add_argument("--weights", default="model", help="which weights: model (default), or a part's set")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


@record
@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    # Settings and position only: the weights are read below, and never the optimizer state
    # of a checkpoint folder.
    ckpt = load_checkpoint(args.checkpoint, tensors=False)
    sections = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig}
    cfg = load_config(args.config, args.overrides, base=ckpt.get("config"), **sections)
    parts = build_parts(cfg, parse_dist_env(os.environ))  # the optional features the config turns on, as in train.py
    env, device = init_distributed_mode(cfg.dist, parts)  # a part may check or set variables first
    try:
        prepare_on_node_leaders(prepare_data, cfg, env, device)  # one writer per node at a time
        with stop_all_if_any_fails(device):
            _, val_set = build_datasets(cfg)
        # As in training: as a part builds it (e.g. sharded, no full copy on any device), else a replica.
        model = build_for_evaluation(lambda: build_model(cfg), cfg, env, device, BLOCKS, parts)
        load_weights(model, Path(args.checkpoint), ckpt, part=args.weights)
        # Its workers end with the `with`, before the process group does.
        hooks = {"collate_fn": getattr(data, "collate_fn", None), "worker_init_fn": leave_stop_signals_to_the_rank}
        with build_val_loader(val_set, cfg, env, device, **hooks) as val_loader:
            step = partial(validation_step, cfg=cfg)
            metrics = evaluate(model, val_loader, step, build_metrics(cfg), device, cfg.train.precision)
        if is_main():
            shown = {"checkpoint": args.checkpoint, "step": ckpt.get("step"), "weights": args.weights}
            print(json.dumps({**shown, **metrics}), flush=True)
    finally:
        for part in parts:
            part.end()
        cleanup_distributed()


if __name__ == "__main__":
    main()
