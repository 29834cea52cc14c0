"""Train the task of model.py on the data of data.py with DistributedDataParallel.

  python train.py [--config config.yaml] [section.key=value ...]    one process
  torchrun --nproc_per_node=4 train.py [section.key=value ...]     4 processes, this machine
  srun python train.py [section.key=value ...]                     one process per SLURM task
  python train.py --print-config                                   every setting, its value and meaning

Re-running with the same output_dir continues from its last checkpoint
(checkpoint.resume=auto).

Exit codes: 0 done (or at train.stop_at_step); 75 stopped by a signal, run it again to continue; 2 bad input.
"""

import argparse
import enum
import functools
import inspect
import os
import time
from pathlib import Path

import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

import data
import recipe
from data import DataConfig, build_datasets, prepare_data
from engine.checkpoint import Checkpointer
from engine.config import effective_batch, format_config, load_config, save_config
from engine.distributed import (
    broadcast_buffers,
    cleanup_distributed,
    init_distributed_mode,
    is_main,
    parse_dist_env,
    prepare_on_node_leaders,
    shorten_timeout_after_first_step,
    stop_all_if_any_fails,
)
from engine.errors import UsageError
from engine.hooks import build_parts
from engine.lifecycle import RunLock, StopRequest, leave_stop_signals_to_the_rank
from engine.loader import build_train_loader, build_val_loader, move_to_device, steps_per_epoch
from engine.logs import QuietLog, RunLog, hand_to_launcher, log, report_errors
from engine.metrics import evaluate
from engine.parallel import build_and_wrap, memory_format, wrap_ddp
from engine.seeding import borrowed_rng, derive_seed, seed_everything, set_determinism
from engine.training import (
    EpochStats,
    NonFiniteGuard,
    TrainState,
    beyond_a_plain_loop,
    build_grad_scaler,
    check_precision,
    forward_backward,
    optimizer_step,
)
from model import BLOCKS, ModelConfig, build_metrics, build_model, training_step, validation_step
from recipe import OptimConfig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="config.yaml", help="YAML config (default: config.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print every setting of the run and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. optim.lr=0.05")
    return parser.parse_args(argv)


@record  # the failing rank's traceback reaches torchrun's summary
@report_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides, data=DataConfig, model=ModelConfig, optim=OptimConfig)
    if args.print_config:
        print(format_config(cfg), end="")
        return 0
    parts = build_parts(cfg, parse_dist_env(os.environ))  # the optional features the config turns on (engine/parts)
    env, device = init_distributed_mode(cfg.dist, parts)  # a part may set variables first
    lock, loaders = None, ()
    try:
        with stop_all_if_any_fails(device):
            if is_main():  # one run per output_dir, taken before anything is written there
                lock = RunLock(cfg.output_dir).acquire()
                for part in parts:
                    part.output_dir_held(cfg.output_dir)  # e.g. a record of rank 0's lines
        stop = StopRequest(cfg.dist.timeout_minutes, cfg.train.stop_at_step).install(env.launcher)
        check_precision(cfg, device)
        set_determinism(cfg.train.deterministic, device)
        checkpointer = Checkpointer(cfg, env, device)
        train_loader, val_loader, state = load_train_objs(cfg, env, device, checkpointer, parts, stop.group)
        loaders = (train_loader, val_loader)
        rng_restored = checkpointer.resume(state)
        if cfg.train.sanity_check:
            sanity_check(state, val_loader, cfg, checkpointer)
        # Rank 0's log and the parts' records, e.g. trackers (a QuietLog elsewhere), closed at the
        # end: their runs as failed on an error.
        with start_run_log(cfg, env, state, loaders) as run_log:
            Run(cfg, env, state, loaders, checkpointer, stop, run_log).train(rng_restored)
    finally:
        if lock is not None:
            lock.release()
        try:
            for loader in loaders:  # their worker processes end before the process group does
                loader.close()
            for part in parts:
                part.end()
        finally:  # even when a second Ctrl-C lands in the loaders' shutdown
            cleanup_distributed(parts)
    return stop.exit_code()  # after the cleanup: STOPPED_EXIT_CODE for a stop by a signal


def load_train_objs(cfg, env, device, checkpointer: Checkpointer, parts: list, vote_group):
    """The run's data loaders and its TrainState (model, optimizer, schedule, the parts).
    The task itself is in data.py and model.py; a stream's ranks vote on `vote_group`, the
    run's stop votes'. Every rank must call this."""
    prepare_on_node_leaders(prepare_data, cfg, env, device)  # downloads: one process per node at a time
    with stop_all_if_any_fails(device):
        train_set, val_set = build_datasets(cfg)  # every process reads at once
    # data.py may define collate_fn; workers leave the launcher's stop signals to their rank.
    hooks = {"collate_fn": getattr(data, "collate_fn", None), "worker_init_fn": leave_stop_signals_to_the_rank}
    train_order = getattr(data, "train_order", None)  # the epoch's sample order, if data.py has its own
    train_loader = build_train_loader(train_set, cfg, env, device, parts, vote_group, **hooks, train_order=train_order)
    val_loader = build_val_loader(val_set, cfg, env, device, **hooks)
    steps = steps_per_epoch(train_loader, cfg)

    seed_everything(cfg.seed)  # the same initial weights on every rank

    def build() -> nn.Module:
        model = build_model(cfg)
        for part in parts:
            model = part.prepare_model(model) or model  # e.g. published weights loaded, parameters frozen
        return model

    # SyncBatchNorm, device, DDP; or as a part builds it (e.g. sharded, no full copy on any device).
    model, train_model = build_and_wrap(build, cfg, env, device, BLOCKS, parts)
    # Parameters a part holds back until a later step (e.g. frozen for the first epochs).
    joins_later = {name: step for part in parts for name, step in (part.joins_later(model, steps) or {}).items()}
    optimizer = build_optimizer(model, cfg, env.world_size, joins_later)
    scheduler = recipe.build_scheduler(optimizer, cfg, steps)
    scaler = build_grad_scaler(cfg.train.precision, device)
    guard = NonFiniteGuard(cfg.train, checkpointer.last_good, scheduler.base_lrs[0], device)
    state = TrainState(model, train_model, optimizer, scheduler, scaler, guard, device, cfg.train.accum_steps, steps)
    for part in parts:
        state.register(part.name, part)
    return train_loader, val_loader, state


def build_optimizer(model: nn.Module, cfg, world_size: int, joins_later: dict[str, int]):
    """recipe.py's build_optimizer; one without `joins_later` (written before 0.9.0) is refused in one line."""
    try:
        inspect.signature(recipe.build_optimizer).bind(model, cfg, world_size, joins_later)
    except TypeError:
        raise UsageError(
            "recipe.py's build_optimizer must take (model, cfg, world_size, joins_later): joins_later maps the "
            "parameters that join training at a later step to that step (empty unless a part holds some back)"
        ) from None
    return recipe.build_optimizer(model, cfg, world_size, joins_later)


def build_augment(cfg, train_set):
    """data.py's build_augment(cfg, train_set): the function that augments each training batch, or None."""
    if hasattr(data, "augment_batch"):  # before 0.8.0: rebuilt its augmentation at every batch
        raise UsageError(
            "data.py's augment_batch(batch, cfg) is now build_augment(cfg, train_set), called once, which returns "
            "the function applied to each training batch (e.g. v2.MixUp(...)); rename it and return that function"
        )
    build = getattr(data, "build_augment", None)
    return build(cfg, train_set) if build else None


def sanity_check(state: TrainState, val_loader, cfg, checkpointer: Checkpointer) -> None:
    """Run validation_step and every metric on each rank's first 2 validation batches, so
    that a mistake there, or a checkpoint.best_metric the task does not report, stops the
    run in seconds instead of after an epoch. It changes nothing: the model evaluates
    (no BatchNorm update), no optimizer steps, and every RNG is put back as it was."""
    with borrowed_rng():
        results = evaluate_weights(state, val_loader, cfg, max_batches=2)
    checkpointer.check_best_metric(results)


def start_run_log(cfg, env, state: TrainState, loaders) -> RunLog | QuietLog:
    """On rank 0: save the resolved config (under the parts' header lines, e.g. what produced
    the run), say what runs, open the run's log and the parts' records (e.g. trackers); a
    QuietLog elsewhere. An unwritable output_dir or a tracker that cannot start stops every
    rank here. Every rank must call this."""
    run_log, (train_loader, val_loader) = QuietLog(), loaders
    per_step = effective_batch(cfg.train, env.world_size)
    with stop_all_if_any_fails(state.device):
        if is_main():
            header = "".join(part.config_header() or "" for part in state.parts)
            save_config(cfg, Path(cfg.output_dir) / "config.yaml", header)
            stream = state.steps_per_epoch is None
            train = "streamed" if stream else f"{len(train_loader.dataset)}"
            length = f"{cfg.train.max_steps} steps" if stream else f"{state.steps_per_epoch} steps/epoch"
            log(
                f"training on {env.world_size} process(es), {state.device.type}, {state.wrapping}, "
                f"{train} train / {len(val_loader.dataset)} val samples; "
                f"effective batch {per_step}; {length}"
            )
            log(recipe.describe(cfg, env.world_size, state.steps_per_epoch))
            log(beyond_a_plain_loop(cfg.train, state, getattr(train_loader.sampler, "epoch_samples", None), per_step))
            run_log = RunLog(cfg, per_step, state.step, state.parts)  # and the parts' records, e.g. trackers
    return run_log


def evaluate_weights(state: TrainState, val_loader, cfg, max_batches=None, stop: StopRequest | None = None):
    """The model's validation metrics and, beside them, those of each part's set of weights
    (e.g. an average's, as <part>_val_*). None if a stop came during an evaluation. Every rank
    must call this."""
    results = evaluate_model(state, val_loader, cfg, max_batches, stop)
    for part in state.parts:
        if results is None or not part.holds_weights:
            continue
        with part.swapped_into_model():  # the same model (sharded or not), holding the part's weights
            more = evaluate_model(state, val_loader, cfg, max_batches, stop)
        if more is None:
            return None
        results |= {f"{part.name}_{key}": value for key, value in more.items() if key.startswith("val_")}
    return results


def evaluate_model(state: TrainState, val_loader, cfg, max_batches, stop: StopRequest | None):
    if state.wrapping == "ddp":  # a sharded model's buffers are rank 0's already
        broadcast_buffers(state.model)  # evaluate and save rank 0's BatchNorm statistics
    metrics = build_metrics(cfg)
    during = stop.during_evaluation() if stop is not None else None
    step = functools.partial(validation_step, cfg=cfg)  # model.py's, with the run's settings
    return evaluate(state.model, val_loader, step, metrics, state.device, cfg.train.precision, max_batches, during)


class Outcome(enum.Enum):
    """How a stretch of training ended. A diverged run does not end here: it raises
    DivergedError, which stops every rank in one line."""

    GO_ON = "go on"  # the run is not over: train on
    DONE = "done"  # the run has its length, or a part ended it (e.g. early stopping)
    STOPPED = "stopped"  # asked to stop (a signal, train.stop_at_step): saved, the same command continues


class Run:
    """The loop's owner: the run's state, checkpointer, stop request and log, and the
    figures since the last evaluation. Every rank holds one and calls its methods alike."""

    def __init__(self, cfg, env, state: TrainState, loaders, checkpointer: Checkpointer, stop: StopRequest, log):
        self.cfg, self.env, self.state = cfg, env, state
        self.checkpointer, self.stop, self.log = checkpointer, stop, log
        self.train_loader, self.val_loader = loaders
        self.training_step = functools.partial(training_step, cfg=cfg)  # model.py's, with the run's settings
        self.augment = build_augment(cfg, self.train_loader.data_set)  # data.py's, if any (e.g. MixUp), built once
        self.step_lr = state.scheduler.get_last_lr()[0]  # the last step's rate (before any, the next's)
        # The losses since the last evaluation, and what the parts measure of the steps (e.g. items, FLOPs).
        self.stats = EpochStats(state.device, state.parts)

    def train(self, rng_restored: bool) -> Outcome:
        """Epoch after epoch, until the run is done or stopped (then with a checkpoint).
        `rng_restored`: the resume put back the RNG of a checkpoint written mid-epoch."""
        state, cfg = self.state, self.cfg
        # A hang fails the run after dist.step_timeout_minutes once the first step is done.
        shorten_timeout_after_first_step(state.optimizer, cfg.dist.step_timeout_minutes, [self.stop.group])
        for part in state.parts:
            part.start(state)  # e.g. a trace's schedule, setup's objects kept out of garbage collections
        self.stats.reset()  # the clock starts with the steps
        if state.batches_done:  # resumed mid-epoch: its figures are this run's part only
            self.log.log(f"epoch {state.epoch}'s train_* figures will cover its steps from {state.step + 1} on")
        outcome = Outcome.DONE if self.done() else Outcome.GO_ON
        while outcome is Outcome.GO_ON:
            if not rng_restored:  # a fresh epoch: dropout etc. seeded per (seed, rank, epoch)
                seed_everything(derive_seed(cfg.seed, self.env.rank, state.epoch))
            rng_restored = False
            if any([part.start_epoch(state) for part in state.parts]):  # e.g. parameters unfrozen
                # DDP fixes at construction which parameters it all-reduces: wrapped anew (the old
                # wrapper, dropped, takes its gradient hooks with it).
                state.train_model = wrap_ddp(state.model, cfg, self.env, state.device)
            outcome = self.train_epoch()
        if outcome is Outcome.STOPPED:
            self.save_stopped()
        elif state.stop_reason():  # a part ended it, also when a resumed run had already stopped
            self.log.log(state.stop_reason())
        return outcome

    def done(self) -> bool:
        """Whether the run has its length, and its last evaluation: train.max_steps steps if
        set, else train.epochs epochs; or a part ended it (e.g. early stopping)."""
        state, last = self.state, self.cfg.train.max_steps
        if state.stop_reason():
            return True
        if not last:
            return state.epoch >= self.cfg.train.epochs
        return state.step > last or (state.step == last and state.evaluated_step == last)

    def augmented(self, batch):
        """A training batch through the augmentation data.py's `build_augment` made, which
        evaluation never sees. Its draws from torch's CPU RNG are seeded per (seed, rank, epoch,
        micro-batch), so a resumed run augments each batch as the run left alone did; the
        caller's RNG is given back."""
        if self.augment is None:
            return batch
        state = self.state
        with borrowed_rng(cpu_generator_only=True) as generator:
            generator.manual_seed(derive_seed(self.cfg.seed, self.env.rank, state.epoch, state.batches_done))
            return self.augment(batch)

    def evaluation_due(self) -> bool:
        """Within an epoch: every train.eval_every_steps steps, and at train.max_steps."""
        step, every, last = self.state.step, self.cfg.train.eval_every_steps, self.cfg.train.max_steps
        return step > 0 and ((every and step % every == 0) or step == last)

    def train_epoch(self) -> Outcome:
        """Train from `state.batches_done` to the end of `state.epoch`, or of the run,
        evaluating where due."""
        state, cfg = self.state, self.cfg
        if self.evaluation_due() and state.evaluated_step != state.step:  # a stop came during it
            outcome = self.evaluate_and_save()
            if outcome is not Outcome.GO_ON:
                return outcome
        self.train_loader.set_epoch(state.epoch, start_batch=state.batches_done)
        progress = self.log.progress(state.epoch, state.steps_per_epoch, state.batches_done // state.accum_steps)
        state.train_model.train()
        try:
            for batch in self.train_loader:
                batch = self.augmented(move_to_device(batch, state.device, memory_format(cfg)))
                with self.stats.measuring(batch):  # what parts measure of it (e.g. the first one's FLOPs)
                    losses = forward_backward(state, batch, self.training_step, cfg.train.precision)  # loss, backward
                self.stats.add(losses)
                if not state.completes_step():
                    continue  # accumulate gradients
                self.step_lr = state.scheduler.get_last_lr()[0]  # this step's: optimizer_step moves the schedule on
                optimizer_step(state, cfg.train)
                progress.update(state.step, losses["loss"], self.step_lr)
                if self.stop.requested(state.step):  # a signal to any rank, or train.stop_at_step
                    return Outcome.STOPPED
                if state.step % cfg.train.log_every_steps == 0:
                    state.guard.check_later()  # a NaN stops every rank an interval later, or at the next save
                if not self.evaluation_due():
                    self.checkpointer.save_if_due(state)  # every checkpoint.every_steps
                    continue
                outcome = self.evaluate_and_save()
                if outcome is not Outcome.GO_ON:
                    return outcome
                state.train_model.train()
        finally:
            progress.close()
        if cfg.train.eval_every_steps:  # the epoch's end is no evaluation of its own
            state.finish_epoch()
            return Outcome.DONE if self.done() else Outcome.GO_ON
        return self.evaluate_and_save(epoch_end=True)

    def evaluate_and_save(self, epoch_end=False) -> Outcome:
        """Evaluate the model, write its metrics row, save it (best.pt too if it is the best
        so far). STOPPED if a stop came during the evaluation: then the state is as before
        it, for a checkpoint from which the next run evaluates again. The RNG is put back as
        it was: how often the run evaluates changes nothing of its training."""
        state = self.state
        train_metrics = self.stats.summary(self.cfg.train.batch_size)  # before the evaluation: not training time
        start = time.perf_counter()
        with borrowed_rng():
            val_metrics = evaluate_weights(state, self.val_loader, self.cfg, stop=self.stop)
        if val_metrics is None:
            which = f"of epoch {state.epoch}" if epoch_end else f"at step {state.step}"
            self.log.log(f"the evaluation {which} stopped; the next run evaluates it again")
            return Outcome.STOPPED
        row = {"epoch": state.epoch, "step": state.step, **train_metrics, **val_metrics}
        for part in state.parts:
            row |= part.epoch_figures(state) or {}  # e.g. every rank's memory
        # outside_train_s: the evaluation's time, and the parts' (e.g. the memory report's).
        row |= {"lr": self.step_lr, "outside_train_s": time.perf_counter() - start}
        # The row before the checkpoint: if the save fails, the next run trains again from the
        # previous checkpoint and rewinds metrics.jsonl to it (RunLog).
        with stop_all_if_any_fails(state.device):
            self.log.write_epoch(row)
        for part in state.parts:
            part.after_evaluation(state, val_metrics)  # before the save, which keeps a part's state
        state.evaluated_step = state.step
        if epoch_end:
            state.finish_epoch()
        self.checkpointer.save(state, val_metrics)  # best.pt by checkpoint.best_metric
        self.stats.reset()
        return Outcome.DONE if self.done() else Outcome.GO_ON

    def save_stopped(self) -> None:
        """The stop's checkpoint, and the line that says how to continue."""
        started = time.monotonic()  # the save's time: what a stop needs before a time limit
        self.checkpointer.save(self.state)
        step = self.state.step
        stopped = (
            f"stopped at step {step} {self.stop.reason(step)}; checkpoint saved in "
            f"{time.monotonic() - started:.1f} s, run the same command to continue"
        )
        self.log.log(stopped)
        if self.stop.exit_code():  # to a launcher's summary too, instead of a failure
            hand_to_launcher(stopped, self.stop.exit_code())


if __name__ == "__main__":
    raise SystemExit(main())
