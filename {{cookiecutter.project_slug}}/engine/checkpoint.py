"""Checkpoints: atomic writes, CPU-mapped reads that run no code, auto-resume.

Layout under <output_dir>/checkpoints/:
  step-00001234.pt   one file per save, written by rank 0
  last.pt            the newest complete checkpoint (what `resume=auto` continues from)
  best.pt            the epoch with the best checkpoint.best_metric so far
The newest `checkpoint.keep_last` step checkpoints are kept.{% if cookiecutter.fsdp %} A part that shards the
model may save folders of every rank's shards instead (step-00001234.dcp/, its module
says how); last.pt and best.pt are then relative links to them, which pruning spares.{% endif %}

last.pt and best.pt are hard links (copies where the file system has none): best.pt
outlives the pruning of its step file. Every command that takes a checkpoint (resume,
init_from, evaluate.py, export.py) takes either.

Atomic: a file is written to a '.*.tmp' file, fsynced and renamed. Names starting with
'.' are never taken for checkpoints, and the next save removes them.

A checkpoint holds plain data only (tensors, numbers, strings, lists, dicts), so it loads
with `torch.load(weights_only=True)`, which refuses to run code hidden in a pickle.
Every load goes through `load_checkpoint`, which checks what the checkpoint holds
(`check_contents`): a file that is not a checkpoint of this project, or one of a newer
format, is refused in one line before anything uses it. The weights export.py writes load
through `load_exported_weights` (model.pt, model.safetensors); every set of weights is
checked against the model, names, shapes and dtypes, by `check_shapes`.
"""

import dataclasses
import importlib.util
import math
import os
import pickle
import pickletools
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from engine.config import Config, TrainConfig, effective_batch, field_default, plain
from engine.distributed import DistEnv, all_gather_objects, gather_objects_on_main, is_main, stop_all_if_any_fails
from engine.errors import CheckpointError, UsageError
from engine.files import atomic_write, fsync_dir
from engine.logs import log
{% if cookiecutter.fsdp %}from engine.parts import modules
{% endif %}from engine.seeding import capture_rng_state, restore_rng_state

# step-00001234.pt, step-00001234.dcp, and a folder saved again at its step, step-00001234.1.dcp
STEP_FILE = re.compile(r"^step-(\d+)(?:\.(\d+))?\.(pt|dcp)$")
LINKS = ("last.pt", "best.pt")
PREFIXES = ("module.", "_orig_mod.")  # added by DDP and torch.compile wrappers

# Written in every checkpoint as "format_version"; raise it when what a checkpoint holds,
# or what it means, changes, so that an older engine refuses a newer checkpoint in one line
# instead of misreading it. A checkpoint without it was written in format 1.
# Format 2: the optimizer's settings in the config's optim section (train.lr and the like
# before), registered states under "states", and "weight_sets" naming the parts' weights.
CHECKPOINT_FORMAT = 2
SHAPE = ("batch_size", "accum_steps")  # train's keys that, with the world size, decide the data's order
# What every checkpoint of this project holds, and of which type ("model", a dict of
# tensors, too); a folder's run state holds all but the tensors, which its metadata lists.
RUN_STATE_TYPES = {
    "step": int,
    "epoch": int,
    "batches_done": int,
    "config": dict,
    "world_size": int,
    "rng": list,
    "scheduler": dict,
    "scaler": dict,
}
ZIP_HEAD = b"PK\x03\x04"  # torch.save's files are zip archives
LEGACY_HEAD = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[:-1]  # torch.save's files before zip


class UnusableCheckpoint(CheckpointError):
    """A checkpoint that cannot be used: `problem` says why (what auto-resume warns before
    it tries an older one), the message adds what to do."""

    def __init__(self, problem: str, remedy: str = "use another checkpoint"):
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem


def written_by_newer_torch(path: Path, name: str) -> UnusableCheckpoint:
    lacks = f"it names {name}, which torch {torch.__version__} lacks"
    return UnusableCheckpoint(
        f"checkpoint {str(path)!r} was written by a newer torch: {lacks}",
        "load it with that torch, or re-export it there",
    )


def torch_lacks(name: str) -> bool:
    """Whether `name` ('torch.x.Y') is torch's but not in this torch: a newer one wrote it.
    Only torch's own modules are looked at, and none is imported."""
    module, _, attribute = name.rpartition(".")
    if module != "torch" and not module.startswith("torch."):
        return False
    loaded = sys.modules.get(module)
    if loaded is not None:
        return attribute not in vars(loaded)
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # a parent package this torch lacks
        return True


def refused_global(error: BaseException) -> str | None:
    """The function or class the weights-only unpickler refused, e.g. 'io.open'."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else None


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(state: dict, directory: Path, step: int, keep_last: int, is_best: bool) -> Path:
    """Write `state` as step-<step>.pt, then point last.pt (and best.pt) at it. Rank 0 only."""
    path = directory / f"step-{step:08d}.pt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory, path.name, lambda f: torch.save(state, f))
        publish(path, directory / "last.pt")
        if is_best:
            publish(path, directory / "best.pt")
        prune(directory, keep_last)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
        raise write_failed(path, error) from None
    return path


def write_failed(path: Path, error: OSError | RuntimeError) -> CheckpointError:
    """One line for a checkpoint that could not be written: the system's reason (e.g. "No
    space left on device"), else the error's first line."""
    return CheckpointError(f"cannot write {str(path)!r}: {getattr(error, 'strerror', None) or one_line(error)}")


def publish(source: Path, target: Path) -> None:
    """Make `target` a complete copy of `source`, atomically (a hard link where possible)."""
    tmp = target.with_name(f".{target.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # file systems without hard links
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def step_checkpoints(directory: Path) -> list[Path]:
    """step-*.pt files and step-*.dcp folders, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_FILE.match(p.name)]
    return sorted(found, key=step_and_revision)


def step_and_revision(path: Path) -> tuple[int, int]:
    step, revision, _ = STEP_FILE.match(path.name).groups()
    return int(step), int(revision or 0)


def prune(directory: Path, keep_last: int) -> None:
    linked = {os.readlink(directory / name) for name in LINKS if (directory / name).is_symlink()}
    for old in step_checkpoints(directory)[:-keep_last]:
        if old.name not in linked:  # last.pt or best.pt points at it
            remove(old)
    for stale in directory.glob(".*.tmp"):  # left by a process killed mid-write
        remove(stale)


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder. A folder first loses its checkpoint name, so a
    deletion cut short leaves a '.*.tmp' folder, never a torn checkpoint."""
    if path.is_dir() and not path.is_symlink():
        doomed = path if path.name.endswith(".tmp") else path.with_name(f".{path.name}.del.tmp")
        if doomed != path:
            os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def load_checkpoint(path: str | Path, tensors: bool = True) -> dict:
    """Read a checkpoint of this project onto the CPU, refusing anything but plain data
    and anything else than such a checkpoint. A folder is read whole by this process,
    unless `tensors` is False: then without the tensors, which `load_weights` reads
    shard by shard."""
    path = Path(path)
    if path.is_dir():
{%- if cookiecutter.fsdp %}
        return folders(path).read_checkpoint(path, tensors)
{%- else %}
        raise UnusableCheckpoint(
            f"checkpoint {str(path)!r} is a folder, and this project reads .pt files only (folders of shards "
            "come with the fsdp answer when it is generated)",
            "use a .pt checkpoint",
        )
{%- endif %}
    state = load_plain(path)
    check_contents(path, state, tensors_inside=True)
    return state


def check_contents(path: Path, state: dict, tensors_inside: bool) -> None:
    """The one check of what a checkpoint holds, before anything uses it: a format this
    engine reads, and this project's keys with their types (with `tensors_inside`, a
    file's "model" and "optimizer" too)."""
    version = state.get("format_version", 1)
    if type(version) is not int or version < 1:
        raise not_ours(path, f"'format_version' is {version!r}")
    if version > CHECKPOINT_FORMAT:
        raise UnusableCheckpoint(
            f"checkpoint {str(path)!r} was written by a newer version of this project (format {version}; "
            f"this one reads up to {CHECKPOINT_FORMAT})",
            "use that version",
        )
    expected = {**RUN_STATE_TYPES, **({"optimizer": dict} if tensors_inside else {})}
    for key, kind in expected.items():
        if key not in state:
            raise not_ours(path, f"no {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise not_ours(path, f"{key!r} is {a(type(state[key]))}, not {a(kind)}")
    if tensors_inside:
        if "model" not in state:
            raise not_ours(path, "no 'model'")
{%- if cookiecutter.ema %}
        for key in weight_sets(state):
            check_weights(path, key, state.get(key, {}))


def weight_sets(state: dict) -> list[str]:
    """The sets of model weights a checkpoint holds: "model" and its parts' (e.g. "ema")."""
    return ["model", *state.get("weight_sets", ["ema"] if "ema" in state else [])]
{%- else %}
        check_weights(path, "model", state["model"])
{%- endif %}


def check_weights(path: Path, key: str, weights) -> None:
    if not isinstance(weights, dict):
        raise not_ours(path, f"{key!r} is {a(type(weights))}, not a dict of tensors")
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise not_ours(path, f"{key!r} holds {name!r}: {a(type(value))}, not a tensor")


def a(kind: type) -> str:
    """'a list', 'an int'."""
    return f"{'an' if kind.__name__[0] in 'aeiouAEIOU' else 'a'} {kind.__name__}"


def not_ours(path: Path, detail: str) -> UnusableCheckpoint:
    return UnusableCheckpoint(
        f"checkpoint {str(path)!r} is not a checkpoint of this project ({detail})", "use one that train.py wrote"
    )


def load_model_state(path: str | Path) -> tuple[dict, dict]:
{%- if cookiecutter.fsdp %}
    """A checkpoint's model weights, whole, on the CPU, without wrapper prefixes, and the
    config that built them (for export). A file is read once; a folder's optimizer state
    is not read."""
    path = Path(path)
    if path.is_dir():
        config = load_checkpoint(path, tensors=False)["config"]
        return strip_prefixes(folders(path).read_model_weights(path)), config
{%- else %}
    """A checkpoint's model weights, whole, on the CPU, without wrapper prefixes, and the
    config that built them (for export)."""
{%- endif %}
    ckpt = load_checkpoint(path)
    return strip_prefixes(ckpt["model"]), ckpt["config"]


{%- if cookiecutter.fsdp %}


def folders(path: Path):
    """The module of the part that reads and writes checkpoint folders (its FOLDERS); a
    project generated without one refuses a folder in one line."""
    found = next((module.FOLDERS for module in modules() if hasattr(module, "FOLDERS")), None)
    if found is None:
        raise UnusableCheckpoint(
            f"checkpoint {str(path)!r} is a folder, and this project reads .pt files only (folders of shards "
            "come with the fsdp answer when it is generated)",
            "use a .pt checkpoint",
        )
    return found
{%- endif %}


def load_plain(path: Path) -> dict:
    """A torch.save file of a dict of plain data, onto the CPU."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        with warnings.catch_warnings():
            # A pickle torch.save did not write makes torch warn; the error below says what it is.
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            # map_location="cpu": every rank would otherwise load onto the device the
            # tensors were saved from (GPU 0), piling N copies there.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  torch's words for any of them are unclear
        raise unreadable(path, error) from None
    if not isinstance(state, dict):
        raise not_ours(path, f"it holds {a(type(state))}, not a dict")
    return state


def unreadable(path: Path, error: Exception) -> CheckpointError:
    """Why torch.load failed, in this project's words: torch's suggest weights_only=False
    for a hostile file, or say "list index out of range" for a file of something else."""
    refused = "Weights only load failed" in str(error)
    try:
        kind = file_kind(path)
        name = refused_global(error) or (first_global(path) if kind == NOT_TORCH else None)
    except OSError as failure:
        return CheckpointError(f"checkpoint {str(path)!r} cannot be read: {failure.strerror or failure}")
    if name and torch_lacks(name):
        return written_by_newer_torch(path, name)
    if name or (refused and kind == TORN):
        shown = f" ({name})" if name else ""
        what = f"code or objects other than plain data{shown}"
        return UnusableCheckpoint(f"checkpoint {str(path)!r} holds {what}", "refused")
    if kind == TORN:
        return UnusableCheckpoint(f"checkpoint {str(path)!r} is truncated or corrupt")
    return not_ours(path, kind)


TORN = "written by torch.save, then cut short or damaged"
NOT_TORCH = "not a file torch.save writes"


def file_kind(path: Path) -> str:
    """TORN, NOT_TORCH or what else the file is, from its first bytes (and a zip's list
    of contents): torch.save writes zip archives (before torch 1.6, a pickle after a magic number)."""
    with path.open("rb") as f:
        head = f.read(len(LEGACY_HEAD))
    if not head:
        return "an empty file"
    if head.startswith(ZIP_HEAD):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile:  # the list of its contents, at its end, is missing
            return TORN
        return TORN if any(name.endswith("/data.pkl") for name in names) else "a zip archive torch.save did not write"
    return TORN if head == LEGACY_HEAD else NOT_TORCH


def first_global(path: Path) -> str | None:
    """The first function or class a plain pickle names ('posix.system'), found without
    running it (pickletools only decodes); None for a file that is no pickle."""
    strings: list[str] = []
    try:
        with path.open("rb") as f:
            if f.read(1) != pickle.PROTO:  # protocol 2 or later: what pickle.dumps writes
                return None
            f.seek(0)
            for opcode, arg, _ in pickletools.genops(f):
                if opcode.name == "GLOBAL":
                    return arg.replace(" ", ".")
                if opcode.name == "STACK_GLOBAL" and len(strings) == 2:
                    return ".".join(strings)
                if isinstance(arg, str):
                    strings = [*strings[-1:], arg]
    except Exception:  # noqa: BLE001  garbage after the first byte, or cut short: nothing named
        return None
    return None


def load_exported_weights(path: Path) -> dict:
    """The weights of a file export.py writes: model.pt (a torch.save dict of tensors, read
    as checkpoints are) or model.safetensors (tensors only, by format); load_model_weights
    then checks them against the model."""
    if path.suffix != ".safetensors":
        weights = load_plain(path)
    else:
        try:
            weights = safetensors.torch.load_file(path)
        except Exception as error:  # noqa: BLE001  a truncated or foreign file alike
            raise UnusableCheckpoint(
                f"cannot read {str(path)!r} as safetensors ({one_line(error)})", "export it again"
            ) from None
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise UnusableCheckpoint(f"{str(path)!r} holds {name!r}: {a(type(value))}, not a tensor", "export it again")
    return weights


def strip_prefixes(state_dict: dict) -> dict:
    """Model weights without wrapper prefixes, so any wrapping loads any other."""
    clean = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        clean[key] = value
    return clean


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Copy weights into `model`, naming the first mismatch if the architectures differ."""
    weights = strip_prefixes(state_dict)
    check_shapes(model, weights, source)
    # Full tensors into a plain{{ ", DDP or FSDP (sharded)" if cookiecutter.fsdp else " or DDP" }} model alike.
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
{%- if cookiecutter.fsdp %}


def load_weights(model: torch.nn.Module, path: Path, ckpt: dict, optimizer=None, part: str = "model") -> None:
    """A checkpoint's model weights (and optimizer state, when `optimizer` is given) into a
    plain, DDP or FSDP model; part="ema": a part's set of weights instead. `ckpt` is
    what load_checkpoint(path, tensors=False) returned: a file's whole contents, or a
    folder's run state, whose tensors each rank then reads shard by shard. Every rank
    must call this."""
    if not has_part(path, ckpt, part):
        raise CheckpointError(f"{path} has no {part!r} weights (that part was off when it was saved)")
    if part in ckpt:
        load_model_weights(model, ckpt[part], str(path))
        return  # a file's optimizer state is loaded by TrainState.load_state_dict
    folders(path).load_into(model, path, optimizer, part)


def has_part(path: Path, ckpt: dict, part: str) -> bool:
    """Whether a checkpoint file, or a folder's metadata, holds `part`."""
    return part in ckpt if "model" in ckpt else folders(path).holds(path, part)
{%- elif cookiecutter.ema %}


def load_weights(model: torch.nn.Module, path: Path, ckpt: dict, part: str = "model") -> None:
    """A checkpoint's model weights into a plain or DDP model; part="ema": a part's set of
    weights instead (the optimizer state is loaded by TrainState.load_state_dict)."""
    if not has_part(path, ckpt, part):
        raise CheckpointError(f"{path} has no {part!r} weights (that part was off when it was saved)")
    load_model_weights(model, ckpt[part], str(path))


def has_part(path: Path, ckpt: dict, part: str) -> bool:
    return part in ckpt
{%- else %}


def load_weights(model: torch.nn.Module, path: Path, ckpt: dict) -> None:
    """A checkpoint's model weights into a plain or DDP model (the optimizer state is
    loaded by TrainState.load_state_dict)."""
    load_model_weights(model, ckpt["model"], str(path))
{%- endif %}
{%- if cookiecutter.ema %}


def load_part_weights(part, model: torch.nn.Module, path: Path, ckpt: dict) -> None:
    """The checkpoint's set of weights of `part` (e.g. the EMA), resharded like the model's;
    a checkpoint saved without them (the part just turned on) leaves them at the model's."""
    if not has_part(path, ckpt, part.name):
        part.reset_weights()
        if is_main():
            log(f"note: {path} has no {part.name!r} weights; they start from the model's weights")
        return
    with part.swapped_into_model():  # loaded as the model's own weights are
        load_weights(model, path, ckpt, part=part.name)
{%- endif %}


# Floating-point weights of these dtypes load into a model of any of them, converted (a
# float16 copy of the weights predicts as float16 weights do); any other dtype must be the model's.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_shapes(model: torch.nn.Module, saved: dict, source: str) -> None:
    """The one check of weights before they load: name the first weight that is missing,
{%- if cookiecutter.fsdp %}
    extra, shaped differently, or of a dtype the model's does not take (FSDP's sharded
    parameters report their full shape). `saved`: the weights, or a folder's as empty
    tensors on the meta device (from its metadata)."""
{%- else %}
    extra, shaped differently, or of a dtype the model's does not take."""
{%- endif %}
    expected = model.state_dict()
    for key, value in expected.items():
        if key not in saved:
            raise CheckpointError(f"{source}: model weight {key!r} is missing from the checkpoint")
        shape, dtype = tuple(saved[key].shape), saved[key].dtype
        if shape != tuple(value.shape):
            raise CheckpointError(
                f"{source}: {key!r} has shape {shape} in the checkpoint "
                f"but {tuple(value.shape)} in the model (different model config?)"
            )
        if dtype != value.dtype and not (dtype in FLOATS and value.dtype in FLOATS):
            raise CheckpointError(
                f"{source}: {key!r} holds {dtype} in the checkpoint but {value.dtype} in the model, which would "
                "load as other numbers; use a file of this model's weights as train.py or export.py writes them"
            )
    unexpected = sorted(set(saved) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: the checkpoint has weight {unexpected[0]!r} the model lacks")


class Checkpointer:
    """The run's checkpoints: when to write them, which is best, and where to resume.

    Every rank must call its methods: they gather every rank's RNG state, and all ranks
    stop together if rank 0 cannot write.
    """

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device{{ ', provenance: dict | None = None' if cookiecutter.run_record }}):
        self.cfg, self.env, self.device = cfg, env, device
{%- if cookiecutter.run_record %}
        self.provenance = provenance  # what produced the run (engine/run_record.py), in every checkpoint
{%- endif %}
        self.directory = checkpoint_dir(cfg.output_dir)

    def save_if_due(self, state) -> None:
        """After every optimizer step: a step checkpoint every checkpoint.every_steps steps."""
        every = self.cfg.checkpoint.every_steps
        if every and state.step % every == 0:
            self.save(state)

    def save(self, state, val_metrics: dict | None = None) -> None:
        """Write a checkpoint now; with an epoch's `val_metrics`, also best.pt if that
        epoch has the best checkpoint.best_metric so far."""
        state.guard.check(state.scaler)  # never save non-finite weights: stop instead
        is_best = val_metrics is not None and self.is_new_best(state, val_metrics)
        rng_states = gather_objects_on_main(capture_rng_state())  # each rank's, for an exact resume; None off rank 0
        run = {
            "format_version": CHECKPOINT_FORMAT,
            "config": self.cfg.to_dict(),
            "world_size": self.env.world_size,
            "rng": rng_states,
{%- if cookiecutter.run_record %}
            **({"provenance": self.provenance} if self.provenance else {}),
{%- endif %}
        }
        keep_last = self.cfg.checkpoint.keep_last
        try:
{%- if cookiecutter.fsdp %}
            if any(part.saves_sharded for part in state.parts):  # folders on any number of processes: one kind per run
                folders(self.directory).save_folder(self, state, {**state.run_state_dict(), **run}, is_best)
                return
{%- endif %}
            payload = {**state.state_dict(), **run}
            with stop_all_if_any_fails(self.device):
                if is_main():
                    save_checkpoint(payload, self.directory, state.step, keep_last, is_best)
        except UsageError as error:
            raise CheckpointError(
                f"checkpoint not saved ({error}); free disk space or choose a writable output_dir "
                "(earlier checkpoints are intact)"
            ) from None

    def last_good(self) -> str:
        """Which checkpoint a run that stops now leaves (checkpoints are written only after
        the non-finite check, so the newest one is good)."""
        steps = step_checkpoints(self.directory)
        if not steps:
            return "no checkpoint was saved before it"
        step = int(STEP_FILE.match(steps[-1].name).group(1))
        return f"the last good checkpoint is {self.directory / 'last.pt'} (step {step}), kept"

    def check_best_metric(self, val_metrics: dict) -> None:
        """checkpoint.best_metric must be one of the metrics validation reports."""
        name = self.cfg.checkpoint.best_metric
        if name not in val_metrics:
            known = ", ".join(key for key in val_metrics if "val_" in key)
            raise CheckpointError(
                f"checkpoint.best_metric is {name!r}, which this task does not report (it reports {known}); "
                "set checkpoint.best_metric to one of them"
            )

    def is_new_best(self, state, val_metrics: dict) -> bool:
        """Whether `val_metrics` beat the best so far (then recorded in `state`). Every
        rank decides alike: the metrics are the same on every rank."""
        name, mode = self.cfg.checkpoint.best_metric, self.cfg.checkpoint.best_mode
        self.check_best_metric(val_metrics)
        value, best = val_metrics[name], state.best_metric_value
        if best is not None and not (value > best if mode == "max" else value < best):
            return False
        state.best_metric_value = value
        return True

    def resume(self, state) -> bool:
        """Continue the run from its checkpoint, or initialise weights for fine-tuning.
        Returns True when the RNG state was restored (mid-epoch resume, same layout)."""
        with stop_all_if_any_fails(self.device):
            found = load_resume_checkpoint(self.cfg)
        seen = all_gather_objects(None if found is None else (str(found[0]), found[1]["step"]))
        if any(view != seen[0] for view in seen):
            raise CheckpointError(
                f"processes see different checkpoints in {self.cfg.output_dir!r} ({seen[0]} vs {seen[-1]}); "
                "put output_dir on a file system that every node shares"
            )
        if found is None:
            init_from = self.cfg.checkpoint.init_from
            if init_from:
                with stop_all_if_any_fails(self.device):  # unreadable on some node: every rank stops
                    ckpt = load_checkpoint(init_from, tensors=False)
                load_weights(state.model, Path(init_from), ckpt)
{%- if cookiecutter.ema %}
                for part in state.parts:
                    part.reset_weights()  # e.g. an average of the weights fine-tuning starts from
{%- endif %}
                if is_main():
                    log(f"initialised model weights from {init_from} (fine-tuning)")
            return False
        path, ckpt = found
        refuse_changed_settings(path, ckpt["config"], self.cfg)
{%- if cookiecutter.freezing %}
        # An epoch's end counts as that epoch (e.g. for which parameters were frozen).
        trained_epoch = ckpt["epoch"] - 1 if ckpt["batches_done"] == 0 and ckpt["epoch"] > 0 else ckpt["epoch"]
        for part in state.parts:
            part.before_load(state, trained_epoch)
{%- endif %}
        load_weights(state.model, path, ckpt{{ ', state.optimizer' if cookiecutter.fsdp }})
{%- if cookiecutter.ema %}
        for part in state.parts:
            if part.holds_weights:
                load_part_weights(part, state.model, path, ckpt)
{%- endif %}
        run_lr = state.scheduler.base_lrs[0]  # this run's, before the checkpoint's replaces it
        state.load_state_dict(ckpt)
        if is_main():
            log(f"resumed from {path}: epoch {state.epoch}, step {state.step}")
        return self.continue_data_position(state, ckpt, run_lr)

    def continue_data_position(self, state, ckpt: dict, run_lr: float) -> bool:
        """Restore this rank's RNG state when the layout is the same; otherwise continue at
        the same sample of the epoch's permutation, in whole steps. True if restored.
        `run_lr`: the base lr this run's recipe chose, which the checkpoint's replaced."""
        saved, train = ckpt["config"].get("train", {}), self.cfg.train
        saved_lr = state.scheduler.base_lrs[0]
        changed = not math.isclose(saved_lr, run_lr) or ckpt["config"].get("optim") != plain(self.cfg.optim)
        if is_main() and changed:
            log(f"note: the optimizer continues with the checkpoint's lr ({saved_lr:.4g}) and settings")
        if state.batches_done == 0:
            return False
        world_size = self.env.world_size
        saved = {key: saved.get(key, field_default(TrainConfig.__dataclass_fields__[key])) for key in SHAPE}
        if (ckpt["world_size"], saved["batch_size"], saved["accum_steps"]) == (
            world_size,
            train.batch_size,
            train.accum_steps,
        ):
            restore_rng_state(ckpt["rng"][self.env.rank])
            return True
        samples_done = state.batches_done * saved["batch_size"] * ckpt["world_size"]
        state.batches_done = samples_done // effective_batch(train, world_size) * train.accum_steps
        if is_main():
            log(
                f"note: the checkpoint was written by {ckpt['world_size']} processes x batch {saved['batch_size']} x "
                f"{saved['accum_steps']} accum_steps and this run has {world_size} x {train.batch_size} x "
                f"{train.accum_steps}; model and optimizer continue exactly, the data order from here differs"
            )
        return False


def load_resume_checkpoint(cfg: Config) -> tuple[Path, dict] | None:
    """The checkpoint to continue from (checkpoint.resume: auto, none or a path).

    auto takes last.pt in output_dir. If it cannot be used (a truncated copy, a full
    disk), it says so and takes the newest step checkpoint that can. A last.pt that
    train.py did not leave (a link elsewhere, or older than a step checkpoint beside it:
    replaced by hand, or left by a run that went back to an older checkpoint) is refused:
    continuing from it would overwrite and prune the newer checkpoints. Every rank must
    call this: each reads the same files alike.
    """
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume != "auto":
        path = Path(cfg.checkpoint.resume)
        return path, load_checkpoint(path, tensors=False)
    directory = checkpoint_dir(cfg.output_dir)
    last, steps = directory / "last.pt", list(reversed(step_checkpoints(directory)))
    if not os.path.lexists(last):  # a broken link is there: said, not skipped
        return newest_usable(steps, directory)
    refuse_foreign_link(last)
    steps = [path for path in steps if not same_file(path, last)]
    ckpt = usable(last)
    if ckpt is None:
        return newest_usable(steps, directory)
    newer = [path for path in steps if step_and_revision(path)[0] > ckpt["step"]]
    if newer:
        raise CheckpointError(
            f"checkpoint {str(last)!r} is step {ckpt['step']}, but {newer[0].name} beside it is newer; {CONTINUE_HOW}"
        )
    return last, ckpt


CONTINUE_HOW = "remove it to continue from the newest step checkpoint, or set checkpoint.resume=PATH"


def refuse_foreign_link(last: Path) -> None:
    """last.pt is a hard link to a step file, or a relative link to a step-*.dcp folder
    beside it: a link to anything else was made by hand, and continuing from it could
    overwrite the newer checkpoints beside it."""
    if not last.is_symlink():
        return
    target = os.readlink(last)
    named = STEP_FILE.match(target)
    if not (named and named.group(3) == "dcp"):  # a name alone: no folder part, not absolute
        raise CheckpointError(
            f"checkpoint {str(last)!r} links to {target!r}, not to a step-*.dcp folder beside it; {CONTINUE_HOW}"
        )


def same_file(path: Path, other: Path) -> bool:
    """Whether two names are one checkpoint (a hard link, or a link to a folder)."""
    try:
        return os.path.samefile(path, other)
    except OSError:  # a broken link
        return False


def usable(path: Path) -> dict | None:
    """The checkpoint's run state, or None when it cannot be used, which is said."""
    try:
        return load_checkpoint(path, tensors=False)
    except CheckpointError as error:
        if is_main():
            log(f"warning: {getattr(error, 'problem', error)}; trying an older checkpoint")
        return None


def newest_usable(paths: list[Path], directory: Path) -> tuple[Path, dict] | None:
    """The first of `paths` (newest first) that can be used; None if there are no
    checkpoints at all, an error if none of them can."""
    for path in paths:
        ckpt = usable(path)
        if ckpt is not None:
            return path, ckpt
    if paths or os.path.lexists(directory / "last.pt"):
        raise CheckpointError(
            f"no readable checkpoint in {str(directory)!r}; move it away to start over, or set checkpoint.resume=PATH"
        )
    return None


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """'section.key: old -> new' for each setting that changes what the weights mean: the
    seed and the task's data and model sections, but for the keys each section lists in
    `may_change_on_resume` (e.g. where the files are, how they are augmented){% if cookiecutter.freezing %}; and the
    sections that say `fixed_on_resume` (e.g. freeze, which shapes the optimizer){% endif %}.

    The schema may have grown since the checkpoint: a key it lacks counts as its default
    (the default keeps the old behaviour), and one the schema no longer has is ignored.
    Keys set in both come first, in schema order: what the user changed, before the keys
    new since the checkpoint."""
{%- if cookiecutter.freezing %}
    fixed = [name for name, section in cfg.sections.items() if getattr(section, "fixed_on_resume", False)]
{%- endif %}
    changes = section_changes("", saved, cfg, only=("seed",))
    for name in ("data", "model"{{ ", *fixed" if cookiecutter.freezing }}):
        changes += section_changes(f"{name}.", saved.get(name) or {}, getattr(cfg, name))
    return [str(change) for change in sorted(changes, key=lambda change: change.new_key)]  # stable: schema order


@dataclasses.dataclass(frozen=True)
class SettingChange:
    name: str
    old: object  # for a new key, its default (MISSING if it has none)
    new: object
    new_key: bool  # absent from the checkpoint's config

    def __str__(self) -> str:
        new = repr(plain(self.new))
        if not self.new_key:
            return f"{self.name}: {plain(self.old)!r} -> {new}"
        if self.old is dataclasses.MISSING:
            return f"{self.name}: new key, no default -> {new}"
        return f"{self.name}: new key, default {plain(self.old)!r} -> {new}"


def section_changes(prefix: str, saved: dict, section, only=None, new_key=False) -> list[SettingChange]:
    """The changes of a config section (a dataclass) from `saved`, its values as the
    checkpoint holds them; `only`: just these fields."""
    free = getattr(section, "may_change_on_resume", ())
    changes = []
    for f in dataclasses.fields(section):
        if f.name in free or (only is not None and f.name not in only):
            continue
        value, name = getattr(section, f.name), f"{prefix}{f.name}"
        if f.name in saved:
            changes += value_changes(name, saved[f.name], value, new_key)
        else:
            changes += value_changes(name, field_default(f), value, new_key=True)
    return changes


def value_changes(name: str, old, new, new_key: bool) -> list[SettingChange]:
    """A nested section key by key (dotted names); any other value whole, normalised."""
    if dataclasses.is_dataclass(new) and isinstance(old, dict | type(new)):
        old_values = old if isinstance(old, dict) else plain(old)  # a new section's default is a dataclass
        return section_changes(f"{name}.", old_values, new, new_key=new_key)
    return [] if plain(old) == plain(new) else [SettingChange(name, old, new, new_key)]


def refuse_changed_settings(path: Path, saved: dict, cfg: Config) -> None:
    changes = config_changes(saved, cfg)
    if changes:
        raise CheckpointError(
            f"{path} was trained with other settings ({changes[0]}"
            f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); use a new output_dir, "
            f"or checkpoint.resume=none checkpoint.init_from={path} to start from its weights only"
        )
