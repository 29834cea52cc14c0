"""One training step: the state a checkpoint holds, forward and backward of a micro-batch
in the run's precision, the optimizer step and its divergence guard, and the figures of the
steps since the last evaluation."""

import contextlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as dcp_state

from engine.config import Config, TrainConfig
from engine.distributed import all_reduce, is_main
from engine.errors import ConfigError, DivergedError, TaskError, UsageError
from engine.hooks import Part

# train.precision: bf16 and fp16 run the forward passes under autocast; fp16 also scales
# the loss (GradScaler), since its gradients underflow.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NO_OP = contextlib.nullcontext()  # reusable: the steps build no context object where nothing is to be done


def check_precision(cfg: Config, device: torch.device) -> None:
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")


def autocast(precision: str, device: torch.device):
    return NO_OP if precision == "fp32" else torch.autocast(device.type, dtype=AMP_DTYPES[precision])


def build_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    # A disabled scaler (bf16, fp32) passes everything through: the loop has one shape.
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


MIN_FP16_SCALE = 2.0**-10  # 26 halvings below GradScaler's initial 2**16


class NonFiniteGuard:
    """Stops a run whose gradients became NaN or infinite, with its last good checkpoint
    intact, instead of saving non-finite weights as progress. Each step's gradient norm (the
    same on every rank: gradients are all-reduced first) stays on the device, where the first
    bad step is kept. With fp16 the GradScaler skips bad steps itself: such a run diverged
    only when its scale collapsed."""

    def __init__(self, train: TrainConfig, last_good: Callable[[], str], lr: float, device: torch.device):
        self.max_bad_steps, self.last_good, self.lr = train.max_bad_steps, last_good, lr
        self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.skipped_steps = 0  # over the whole run: saved in checkpoints
        self.first_bad_later = LaggedValue()  # what `check_later` started reading

    def skip_step(self, grad_norm: torch.Tensor, step: int) -> bool:
        """Whether to skip the step; reading the norm then syncs, so only with train.max_bad_steps."""
        if hasattr(grad_norm, "full_tensor"):  # a sharded model's (a DTensor): the norm over every shard
            grad_norm = grad_norm.full_tensor()
        if self.max_bad_steps == 0:  # kept on the device: the first step whose norm is not finite
            first = self.first_bad_step
            self.first_bad_step = torch.where(~torch.isfinite(grad_norm) & (first < 0), step, first)
            return False
        if bool(torch.isfinite(grad_norm)):
            return False
        self.skipped_steps += 1
        if self.skipped_steps > self.max_bad_steps:
            skipped = f"after {self.max_bad_steps} skipped (train.max_bad_steps)"
            raise DivergedError(self.message(f"at step {step}, {skipped}"))
        return True

    def check_later(self) -> None:
        """Stop every rank if a step before the previous call was bad, without waiting for the
        device. Every rank calls this at the same steps."""
        first_bad = self.first_bad_later.swap(all_reduce(self.first_bad_step.clone(), "max"))
        if first_bad is not None and first_bad >= 0:
            raise DivergedError(self.message(f"at step {first_bad}"))

    def check(self, scaler: torch.amp.GradScaler) -> None:
        """Stop every rank if a step was bad or fp16's scale collapsed; waits. Every rank calls this."""
        first_bad = int(all_reduce(self.first_bad_step.clone(), "max"))
        if first_bad >= 0:
            raise DivergedError(self.message(f"at step {first_bad}"))
        if scaler.is_enabled() and scaler.get_scale() < MIN_FP16_SCALE:
            raise DivergedError(self.message(f"at every scale (the fp16 loss scale fell below {MIN_FP16_SCALE:g})"))

    def message(self, where: str) -> str:
        return (
            f"training diverged: non-finite gradients {where}; {self.last_good()}. Try a lower learning rate "
            f"(this run's: {self.lr:.4g}; recipe.py, optim: in config.yaml), a longer warmup, or train.grad_clip; "
            "train.max_bad_steps=N skips up to N such steps"
        )


class LaggedValue:
    """A number on the device, read one call later: `swap(tensor)` starts copying it to the
    host and returns what the previous call copied (None the first time), long finished."""

    def __init__(self):
        self.pending = (None, None)  # (host tensor, CUDA event recorded after its copy)

    def swap(self, tensor: torch.Tensor) -> int | float | None:
        host, copied = self.pending
        if copied is not None:
            copied.synchronize()  # the copy of one interval ago: finished long since
        # From a GPU, a non-blocking copy lands in pinned memory: queued, never waited for.
        copy = tensor.to("cpu", non_blocking=True, copy=True)
        self.pending = (copy, torch.cuda.current_stream().record_event() if tensor.is_cuda else None)
        return None if host is None else host.item()


FULL = dcp_state.StateDictOptions(full_state_dict=True)
FULL_ON_CPU = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
CORE_KEYS = {"model", "optimizer", "scheduler", "scaler", "epoch", "batches_done", "step", "config", "rng", "states"}


@dataclass
class TrainState:
    """Everything a checkpoint must hold to continue the run exactly (and the device)."""

    model: nn.Module  # unwrapped: what is saved and evaluated
    train_model: nn.Module  # what is trained: the DDP wrapper, or the model itself
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    guard: NonFiniteGuard  # stops the run when gradients become non-finite
    device: torch.device  # where the model lives (not saved)
    accum_steps: int = 1  # micro-batches per optimizer step (from the config: not saved)
    steps_per_epoch: int | None = 1  # optimizer steps per epoch (from the data: not saved); None: a stream
    parts: list[Part] = field(default_factory=list, init=False)  # the run's optional features: see `register`
    states: dict = field(default_factory=dict, init=False)  # more checkpointed objects, by name: see `register`
    epoch: int = 0  # epoch in progress
    batches_done: int = 0  # micro-batches of `epoch` already trained
    step: int = 0  # optimizer steps taken in the whole run
    best_metric_value: float | None = None  # of checkpoint.best_metric, over the evaluations so far
    evaluated_step: int = 0  # the step of the last evaluation: a resumed run does one left undone

    def register(self, name: str, obj) -> None:
        """Checkpoint `obj` (with state_dict() and load_state_dict(): a counter, a second
        optimizer) under `name`, saved from rank 0 and loaded on resume; a Part gets its hooks."""
        if name in self.states or name in CORE_KEYS or not name:
            raise UsageError(f"a checkpointed state is already named {name!r}; register it under another name")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UsageError(f"{name!r}: a {type(obj).__name__} has no state_dict() and load_state_dict() to save")
        self.states[name] = obj
        if isinstance(obj, Part):
            self.parts.append(obj)
            obj.setup(self)

    def state_dict(self) -> dict:
        """Plain full tensors on the CPU, the same for a replica and a sharded model (so either
        resumes the other), and each part's set of weights. Every rank must call this: a
        sharded model's are gathered."""
        return {
            "model": dcp_state.get_model_state_dict(self.model, options=FULL_ON_CPU),
            "optimizer": dcp_state.get_optimizer_state_dict(self.model, self.optimizer, options=FULL_ON_CPU),
            **{part.name: full_on_main(part.weights()) for part in self.parts if part.holds_weights},
            **self.run_state_dict(),
        }

    def run_state_dict(self) -> dict:
        """All but the weights and the optimizer: small, the same on every rank."""
        states = {name: obj.state_dict() for name, obj in self.states.items()}
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "step": self.step,
            "best_metric_value": self.best_metric_value,
            "evaluated_step": self.evaluated_step,
            "skipped_steps": self.guard.skipped_steps,
            "states": {name: state for name, state in states.items() if state is not None},
            "weight_sets": [part.name for part in self.parts if part.holds_weights],
        }

    def load_state_dict(self, state: dict) -> None:
        """All but the model's weights, which are loaded apart."""
        if "optimizer" in state:
            dcp_state.set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FULL)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch = state["epoch"]
        self.batches_done = state["batches_done"]
        self.step = state["step"]
        self.best_metric_value = state.get("best_metric_value")  # absent in older checkpoints
        self.evaluated_step = state.get("evaluated_step", self.step)
        self.guard.skipped_steps = state.get("skipped_steps", 0)
        saved = state.get("states", {})
        for name, obj in self.states.items():
            found = saved.get(name, state.get(name))  # older: at the top (`register` refuses CORE_KEYS)
            if isinstance(found, dict):  # else new since the checkpoint: it starts afresh
                obj.load_state_dict(found)

    @property
    def wrapping(self) -> str:
        """ddp, or the part that builds and wraps the model (e.g. sharded)."""
        return next((part.name for part in self.parts if part.saves_sharded), "ddp")

    def stop_reason(self) -> str | None:
        """Why the run ends before its last epoch (a part's, e.g. early stopping), if it does."""
        return next((reason for part in self.parts if (reason := part.stop_reason(self))), None)

    def completes_step(self) -> bool:
        """Whether the micro-batch in progress is the last one of an optimizer step."""
        return self.batches_done % self.accum_steps == 0

    def finish_epoch(self) -> None:
        self.epoch, self.batches_done = self.epoch + 1, 0


def beyond_a_plain_loop(train: TrainConfig, state: TrainState, epoch_samples: int | None, per_step: int) -> str:
    """The opening line on what this run does to the math that a plain loop would not, each
    with the setting that turns it off (recipe.py's line says how the lr came about)."""
    said = [f"gradients clipped to norm {train.grad_clip:g} (train.grad_clip=0: off)"] if train.grad_clip else []
    if any(isinstance(module, nn.SyncBatchNorm) for module in state.model.modules()):
        said.append("BatchNorm statistics over every process (dist.sync_bn=false: each its own)")
    if epoch_samples is not None and (tail := epoch_samples - state.steps_per_epoch * per_step):
        said.append(f"each epoch leaves out its last {tail} of {epoch_samples} samples (less than one effective batch)")
    if train.accum_steps > 1:
        said.append(f"gradients of {train.accum_steps} micro-batches summed per step (train.accum_steps)")
    return "beyond a plain loop: " + ("; ".join(said) or "nothing")


def forward_backward(state: TrainState, batch, training_step, precision: str) -> dict[str, torch.Tensor]:
    """Forward and backward of one micro-batch; its losses, detached ("loss" and any named).
    Gradients of `accum_steps` micro-batches are summed locally and all-reduced on the last:
    a step sees the mean over batch_size x world size x accum_steps samples."""
    accum = state.accum_steps
    state.batches_done += 1
    with NO_OP if state.completes_step() else without_gradient_sync(state.train_model):
        with autocast(precision, state.device):
            losses = named_losses(call_training_step(training_step, state.train_model, batch))
        state.scaler.scale(losses["loss"] / accum if accum > 1 else losses["loss"]).backward()
    return {name: loss.detach() for name, loss in losses.items()}


def call_training_step(training_step, model: nn.Module, batch):
    """training_step's output; DDP's failure when a parameter got no gradient in the previous step, in one line."""
    try:
        return training_step(model, batch)
    except RuntimeError as error:
        if "Expected to have finished reduction in the prior iteration" not in str(error):
            raise
        trained = [name for name, p in model.named_parameters() if p.requires_grad]
        listed = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(error))
        indices = [int(i) for i in listed.group(1).split()] if listed else []
        names = [trained[i].removeprefix("module.") for i in indices if i < len(trained)]
        which = f" ({', '.join(names)})" if names else ""
        raise UsageError(
            f"a model parameter{which} got no gradient in a training step, and DDP needs every parameter in every "
            "step's loss; set dist.find_unused_parameters=true (for branches unused in some steps), or set "
            "requires_grad=False on parameters that are never used"
        ) from None


def named_losses(output) -> dict[str, torch.Tensor]:
    """training_step's output as {"loss": total, name: loss, ...}, each one number."""
    if isinstance(output, torch.Tensor):
        check_loss("the loss training_step returned", output)
        return {"loss": output}
    if not isinstance(output, dict) or not output:
        raise TaskError(
            "training_step must return the loss (a tensor) or a dict of named loss tensors, "
            f"not {type(output).__name__ if output != {} else 'an empty dict'}"
        )
    if "loss" in output:
        raise TaskError('training_step returned a loss named "loss": that name is their sum; rename it')
    for name, loss in output.items():
        check_loss(f"training_step's loss {name!r}", loss)
    return {"loss": sum(output.values()), **output}


def check_loss(what: str, loss) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TaskError(
            f"{what} is a {type(loss).__name__}, not a tensor; return tensors computed from the model's output "
            "(leave out a term that is a constant)"
        )
    if loss.ndim != 0:
        raise TaskError(
            f"{what} has shape {list(loss.shape)}, not a single number (a 0-dim tensor); reduce it, e.g. with "
            '.mean(), or with the loss function\'s default reduction="mean" instead of "none"'
        )


def without_gradient_sync(model: nn.Module):
    """Skip the all-reduce on micro-batches that only accumulate."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    # DDP's no_sync, or one a part gives the model it wraps (e.g. sharded); one process: nothing to sync.
    return model.no_sync() if hasattr(model, "no_sync") else NO_OP


def optimizer_step(state: TrainState, train: TrainConfig) -> None:
    """Clip, update (unless the guard skips a non-finite step), advance the schedule."""
    if train.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)  # clip true gradients, not scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), train.grad_clip)
    elif not state.scaler.is_enabled():
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in state.model.parameters() if p.grad is not None])
    # fp16's GradScaler skips non-finite steps itself.
    if state.scaler.is_enabled() or not state.guard.skip_step(grad_norm, state.step + 1):
        state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1
    for part in state.parts:
        part.after_step(state)


def full_on_main(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors on the CPU, on rank 0 ({} elsewhere, as for the model's). Every rank
    must call this: a sharded tensor (a DTensor) is gathered."""
    tensors = {name: t.full_tensor() if hasattr(t, "full_tensor") else t for name, t in tensors.items()}
    return {name: t.detach().cpu() for name, t in tensors.items()} if is_main() else {}


class EpochStats:
    """The losses since the last evaluation, summed on the device (no host sync), and their
    clock; and `meters`, the parts that measure the steps besides (e.g. the task's items)."""

    def __init__(self, device: torch.device, meters=()):
        self.device, self.meters = device, [part for part in meters if part.measures_steps]
        self.reset()

    def reset(self) -> None:
        self.loss_sums = {"loss": torch.zeros((), device=self.device)}  # and named losses, once seen
        self.micro_batches = 0
        self.start = time.perf_counter()
        for meter in self.meters:
            meter.reset_figures()

    def measuring(self, batch):
        """Around a micro-batch's forward and backward: what the meters measure of it."""
        if not self.meters:
            return NO_OP
        stack = contextlib.ExitStack()
        for meter in self.meters:
            stack.enter_context(meter.measure(batch))
        return stack

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for name, loss in losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0) + loss.float()
        self.micro_batches += 1

    def summary(self, batch_size: int) -> dict:
        """train_<name>: each loss's mean over every rank's samples, the speed, and the meters'
        figures. Every rank calls this."""
        elapsed = time.perf_counter() - self.start
        names = list(self.loss_sums)
        sums = [self.loss_sums[name].double() for name in names]
        count = torch.tensor(float(self.micro_batches), dtype=torch.float64, device=sums[0].device)
        *totals, micro_batches = all_reduce(torch.stack([*sums, count])).tolist()
        measured = [meter.train_figures(self.micro_batches, elapsed) for meter in self.meters]
        return {
            # No micro-batches: the epoch was trained by the run before (then NaN).
            **{f"train_{name}": total / (micro_batches or math.nan) for name, total in zip(names, totals, strict=True)},
            "samples_per_s": micro_batches * batch_size / max(elapsed, 1e-9),
            **{key: value for figures in measured for key, value in figures.items()},
            "train_time_s": elapsed,
        }
