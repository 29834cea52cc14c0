"""Train a classifier with DistributedDataParallel.

  python train.py [--config config.yaml] [section.key=value ...]    one process
  torchrun --nproc_per_node=4 train.py [section.key=value ...]     4 processes, this machine
  srun python train.py [section.key=value ...]                     one process per SLURM task

Re-running with the same output_dir continues from its last checkpoint
(checkpoint.resume=auto).
"""

import argparse
import functools
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from checkpoint import resume_train_state, save_train_state
from config import Config, load_config, save_config
from data import build_datasets, prepare_data
from distributed import (
    DistEnv,
    barrier,
    broadcast_buffers,
    cleanup_distributed,
    init_distributed_mode,
    run_everywhere,
    run_on_main,
    run_on_node_leaders,
)
from engine import TrainState, evaluate, train_one_epoch
from loader import build_train_loader, build_val_loader, with_num_classes
from logs import (
    NoTensorBoardLog,
    TensorBoardLog,
    log,
    make_metrics_log,
    make_progress,
    make_tensorboard_log,
    report_errors,
)
from memory import freeze_setup_objects, report_memory
from model import BLOCKS, build_model
from optim import build_grad_scaler, build_optimizer, build_scheduler, check_precision
from parallel import wrap_model
from preemption import StopRequest
from seeding import derive_seed, seed_everything, set_determinism


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config.yaml", help="YAML config (default: config.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.lr=0.05")
    return parser.parse_args(argv)


@dataclass
class Run:
    """What stays fixed while the epochs go by."""

    cfg: Config
    env: DistEnv
    device: torch.device
    train_loader: DataLoader
    val_loader: DataLoader
    stop_request: StopRequest
    memory_report_step: int  # report per-rank memory once, early, at this step
    tensorboard_log: TensorBoardLog | NoTensorBoardLog


@record  # the failing rank's traceback reaches torchrun's summary
@report_errors
def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    env, device = init_distributed_mode(cfg.dist)
    try:
        stop_request = StopRequest(cfg.dist.timeout_minutes).install()
        check_precision(cfg, device)
        set_determinism(cfg.train.deterministic, device)

        run_on_node_leaders(lambda: prepare_data(cfg), env, device)  # one writer per node at a time
        train_set, val_set = run_everywhere(lambda: build_datasets(cfg), device)
        cfg = with_num_classes(cfg, train_set)
        train_loader = build_train_loader(train_set, cfg, env, device)
        val_loader = build_val_loader(val_set, cfg, env, device)
        steps_per_epoch = train_loader.sampler.num_batches // cfg.train.accum_steps

        seed_everything(cfg.seed)  # identical initial weights on every rank
        model, train_model = wrap_model(build_model(cfg), cfg, env, device, BLOCKS)

        optimizer = build_optimizer(model, cfg.train)
        scheduler = build_scheduler(optimizer, cfg.train, steps_per_epoch)
        state = TrainState(model, train_model, optimizer, scheduler, build_grad_scaler(cfg.train.precision, device))

        rng_restored = resume_train_state(state, cfg, env.rank, env.world_size, device)
        run_on_main(lambda: save_config(cfg, Path(cfg.output_dir) / "config.yaml"), device)
        log(
            f"training on {env.world_size} process(es), {device.type}, {cfg.train.strategy}; {len(train_set)} "
            f"train / {len(val_set)} val samples; effective batch "
            f"{cfg.train.batch_size * env.world_size * cfg.train.accum_steps}; {steps_per_epoch} steps/epoch"
        )

        metrics_log = make_metrics_log(cfg.output_dir)
        tensorboard_log = run_everywhere(
            lambda: make_tensorboard_log(cfg.output_dir, cfg.train.tensorboard, start_step=state.step), device
        )
        memory_report_step = state.step + min(10, steps_per_epoch)
        run = Run(cfg, env, device, train_loader, val_loader, stop_request, memory_report_step, tensorboard_log)
        freeze_setup_objects()  # no full garbage collection pauses inside the steps
        try:
            while state.epoch < cfg.train.epochs and not state.stopped_early:
                if not rng_restored:  # a fresh epoch: dropout etc. seeded per (seed, rank, epoch)
                    seed_everything(derive_seed(cfg.seed, env.rank, state.epoch))
                rng_restored = False
                epoch_metrics = run_epoch(state, run)
                if epoch_metrics:
                    run_on_main(functools.partial(metrics_log.write, epoch_metrics), device)
                    run_on_main(functools.partial(tensorboard_log.write_epoch, epoch_metrics), device)
                    log(format_metrics(epoch_metrics))
        finally:
            tensorboard_log.close()  # what is still buffered reaches the disk, also on failure
        barrier(device)  # leave together: tearing down a group with peers mid-call can abort
    finally:
        gc.unfreeze()
        cleanup_distributed()


def run_epoch(state: TrainState, run: Run) -> dict | None:
    """Train the rest of the current epoch, evaluate, checkpoint. Returns the epoch's
    metrics, or None when training stopped early (after writing a step checkpoint)."""
    cfg, epoch, accum = run.cfg, state.epoch, run.cfg.train.accum_steps
    run.train_loader.sampler.set_epoch(epoch, start_batch=state.batches_done)
    steps_per_epoch = run.train_loader.sampler.num_batches // accum
    done_steps = state.batches_done // accum
    samples_per_step = cfg.train.batch_size * run.env.world_size * accum  # the effective batch
    progress = make_progress(
        epoch, steps_per_epoch, done_steps, cfg.train.log_every_steps, samples_per_step, run.tensorboard_log
    )

    def after_step(state) -> bool:
        """Periodic checkpoints and reports; True to stop (stop_at_step or a signal)."""
        stop = run.stop_request.agreed(state.step) or state.step == cfg.train.stop_at_step
        if not stop and cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0:
            save_train_state(state, cfg, run.env.world_size, run.device)
        if state.step == run.memory_report_step:
            report_memory(run.device, f"after step {state.step}", count_tensors=False)
        return stop

    epoch_start = time.perf_counter()
    try:
        train_metrics = train_one_epoch(state, run.train_loader, cfg, run.device, progress, after_step)
    finally:
        progress.close()
    if state.stopped_early:
        save_train_state(state, cfg, run.env.world_size, run.device)
        signal_name = run.stop_request.signal_name
        reason = "at train.stop_at_step" if state.step == cfg.train.stop_at_step and not signal_name else ""
        log(
            f"stopped at step {state.step} {reason or 'by ' + (signal_name or 'a signal to another process')}; "
            "checkpoint saved, run the same command to continue"
        )
        return None
    if cfg.train.strategy == "ddp":
        broadcast_buffers(state.model)
    val_metrics = evaluate(state.model, run.val_loader, run.device, cfg.train.precision)
    memory = report_memory(run.device, f"epoch {epoch}")
    state.epoch, state.batches_done = epoch + 1, 0
    is_best = val_metrics["val_acc"] > state.best_acc
    state.best_acc = max(state.best_acc, val_metrics["val_acc"])
    save_train_state(state, cfg, run.env.world_size, run.device, is_best=is_best)
    # Time spent outside training steps: evaluation, memory report, checkpoint.
    outside_s = time.perf_counter() - epoch_start - train_metrics["train_time_s"]
    lr = state.scheduler.get_last_lr()[0]
    return {
        "epoch": epoch,
        "step": state.step,
        **train_metrics,
        **val_metrics,
        "lr": lr,
        "outside_train_s": outside_s,
        "memory": memory,
    }


def format_metrics(metrics: dict) -> str:
    return (
        f"epoch {metrics['epoch']}: train_loss {metrics['train_loss']:.4f}  val_loss {metrics['val_loss']:.4f}  "
        f"val_acc {metrics['val_acc']:.4f} ({metrics['num_samples']} samples)  "
        f"{metrics['samples_per_s']:.0f} samples/s"
    )


if __name__ == "__main__":
    main()
