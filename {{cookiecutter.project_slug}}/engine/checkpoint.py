"""Checkpoints: atomic writes, reads that run no code (weights_only) and refuse what is not ours, auto-resume.
<output_dir>/checkpoints/ keeps the newest checkpoint.keep_last step-00001234.pt (or a part's folders, .dcp/); last.pt
and best.pt link to them, so best.pt outlives its step file."""

import dataclasses
import importlib.util
import math
import os
import pickle
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
from engine.hooks import modules
from engine.lifecycle import pid_alive
from engine.logs import log
from engine.seeding import capture_rng_state, restore_rng_state

STEP_FILE = re.compile(r"^step-(\d+)(?:\.(\d+))?\.(pt|dcp)$")  # step-00001234.pt, .dcp, a folder saved again: .1.dcp
PREFIXES = re.compile(r"^(?:module\.|_orig_mod\.)+")  # added by DDP and torch.compile wrappers
WRITER_PID = re.compile(r"\.pid(\d+)\.")  # in a temporary file's name: '.step-00000012.pt.pid4242.x1y2.tmp'
CHECKPOINT_FORMAT = 2  # raised on a change of contents, so older engines refuse it (2: optim, "states", "weight_sets")
SHAPE = ("batch_size", "accum_steps")  # train's keys that, with the world size, decide the data's order
RUN_STATE_TYPES = dict(  # what every checkpoint holds besides its tensors ("optimizer", "model")
    step=int, epoch=int, batches_done=int, config=dict, world_size=int, rng=list, scheduler=dict, scaler=dict
)
LEGACY_HEAD = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[:-1]  # torch.save's files before zip
TORN = "written by torch.save, then cut short or damaged"
NOT_TORCH = "not a file torch.save writes"
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # load into each other, converted
CONTINUE_HOW = "remove it to continue from the newest step checkpoint, or set checkpoint.resume=PATH"


class UnusableCheckpoint(CheckpointError):
    """`problem` (what auto-resume warns), then what to do."""

    def __init__(self, problem: str, remedy: str = "use another checkpoint"):
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem


def written_by_newer_torch(path: Path, name: str) -> UnusableCheckpoint:
    return UnusableCheckpoint(
        f"checkpoint {str(path)!r} was written by a newer torch: it names {name}, which torch {torch.__version__} "
        "lacks",
        "load it with that torch, or re-export it there",
    )


def torch_lacks(name: str) -> bool:
    """Whether `name` ('torch.x.Y') is torch's but not this torch's; nothing is imported."""
    module, _, attribute = name.rpartition(".")
    if module.partition(".")[0] != "torch":
        return False
    if module in sys.modules:
        return attribute not in vars(sys.modules[module])
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # a parent package this torch lacks
        return True


def refused_global(error: BaseException) -> str | None:
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else None


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(state: dict, directory: Path, step: int, keep_last: int, is_best: bool) -> Path:
    """Write step-<step>.pt, point last.pt (and best.pt) at it, prune; or one line. Rank 0 only."""
    path = directory / f"step-{step:08d}.pt"
    return publish(path, lambda: atomic_write(directory, path.name, lambda f: torch.save(state, f)), keep_last, is_best)


def publish(path: Path, write, keep_last: int, is_best: bool) -> Path:
    """`write()` the checkpoint `path` (a file, or a part's folder), point last.pt (and best.pt) at it, prune; or
    one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write()
        for link in ["last.pt", "best.pt"][: 1 + is_best]:
            tmp = path.with_name(f".{link}.pid{os.getpid()}.link.tmp")
            tmp.unlink(missing_ok=True)
            if path.is_dir():
                os.symlink(path.name, tmp)  # relative: the checkpoints folder may be moved or mounted elsewhere
            else:
                try:
                    os.link(path, tmp)
                except OSError:  # file systems without hard links
                    shutil.copyfile(path, tmp)
            os.replace(tmp, path.with_name(link))
            fsync_dir(path.parent)
        prune(path.parent, keep_last)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
        reason = getattr(error, "strerror", None) or one_line(error)
        raise CheckpointError(f"cannot write {str(path)!r}: {reason}") from None
    return path


def step_checkpoints(directory: Path) -> list[Path]:
    found = [p for p in directory.iterdir() if STEP_FILE.match(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda path: (step_of(path), int(STEP_FILE.match(path.name)[2] or 0)))  # .1.dcp after


def step_of(path: Path) -> int:
    return int(STEP_FILE.match(path.name)[1])


def prune(directory: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` step checkpoints (and folders last.pt or best.pt link to); remove '.*.tmp'
    leftovers."""
    linked = {os.readlink(link) for link in (directory / "last.pt", directory / "best.pt") if link.is_symlink()}
    for old in [*(p for p in step_checkpoints(directory)[:-keep_last] if p.name not in linked), *leftovers(directory)]:
        remove(old)


def remove(path: Path) -> None:
    """Delete a checkpoint; a folder is first renamed '.*.tmp', so a cut deletion leaves no torn checkpoint."""
    if not path.is_dir() or path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        doomed = path if path.name.endswith(".tmp") else path.rename(path.with_name(f".{path.name}.del.tmp"))
        shutil.rmtree(doomed, ignore_errors=True)


def leftovers(directory: Path) -> list[Path]:
    """'.*.tmp' files and folders that no other live process of this host writes: a run beside this one (refused
    by run.lock, but a folder may be shared by hand) never loses its save."""
    found = []
    for path in directory.glob(".*.tmp"):
        writer = WRITER_PID.search(path.name)
        if writer is None or int(writer[1]) == os.getpid() or not pid_alive(int(writer[1])):
            found.append(path)
    return found


def load_checkpoint(path: str | Path, tensors: bool = True) -> dict:
    """A checkpoint of this project on the CPU, anything else refused in one line (a folder's tensors only with
    `tensors`: else load_weights reads them shard by shard)."""
    path = Path(path)
    if path.is_dir():
        return folders(path).read_checkpoint(path, tensors)
    state = load_plain(path)
    check_contents(path, state)
    return state


def check_contents(path: Path, state: dict) -> None:
    """Its format, keys and types, before anything uses it."""
    version = state.get("format_version", 1)
    if type(version) is not int or version < 1:
        raise not_ours(path, f"'format_version' is {version!r}")
    if version > CHECKPOINT_FORMAT:
        raise UnusableCheckpoint(
            f"checkpoint {str(path)!r} was written by a newer version of this project (format {version}; "
            f"this one reads up to {CHECKPOINT_FORMAT})",
            "use that version",
        )
    for key, kind in {**RUN_STATE_TYPES, "optimizer": dict, "model": dict}.items():
        if key not in state:
            raise not_ours(path, f"no {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise not_ours(path, f"{key!r} is {a(type(state[key]))}, not {a(kind)}")
    for key in weight_sets(state):
        weights = state.get(key, {})  # a part's set is missing when that part was off
        if not isinstance(weights, dict):
            raise not_ours(path, f"{key!r} is {a(type(weights))}, not a dict")
        for name, value in weights.items():
            if not isinstance(value, torch.Tensor):
                raise not_ours(path, f"{key!r} holds {name!r}: {a(type(value))}, not a tensor")


def weight_sets(state: dict) -> list[str]:
    """The model's and the parts' sets of weights in a checkpoint file, as it lists them (format 1 did not:
    there, every other dict of tensors at its top, e.g. an average)."""
    if "weight_sets" in state:
        return ["model", *state["weight_sets"]]
    tensors = [key for key, value in state.items() if isinstance(value, dict) and value and key != "model"]
    return ["model", *(key for key in tensors if all(isinstance(t, torch.Tensor) for t in state[key].values()))]


def a(kind: type) -> str:
    """'a list', 'an int'."""
    return f"{'an' if kind.__name__[0] in 'aeiouAEIOU' else 'a'} {kind.__name__}"


def not_ours(path: Path, detail: str) -> UnusableCheckpoint:
    return UnusableCheckpoint(
        f"checkpoint {str(path)!r} is not a checkpoint of this project ({detail})", "use one that train.py wrote"
    )


def load_model_state(path: str | Path) -> tuple[dict, dict]:
    """A checkpoint's whole model weights and the config that built them."""
    ckpt = load_checkpoint(path, tensors=False)  # a file whole; a folder's run state only
    if Path(path).is_dir():  # its weights read whole from the shards, whatever its run state holds
        ckpt |= folders(Path(path)).load_full(Path(path), keys={"model"})
    return strip_prefixes(ckpt["model"]), ckpt["config"]


def folders(path: Path):
    """The module of the part that reads and writes checkpoint folders (e.g. sharded ones), to read `path`."""
    found = next((module.FOLDERS for module in modules() if hasattr(module, "FOLDERS")), None)
    if found is None:
        raise UnusableCheckpoint(
            f"checkpoint {str(path)!r} is a folder, and this project reads .pt files only (folders of shards "
            "come with the fsdp answer when it is generated)",
            "use a .pt checkpoint",
        )
    return found


def load_plain(path: Path) -> dict:
    """A torch.save file of a dict of plain data, onto the CPU."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found")
    try:
        with warnings.catch_warnings():  # a pickle torch.save did not write: unreadable() says what it is
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  torch's words for any of them are unclear
        raise unreadable(path, error) from None
    if not isinstance(state, dict):
        raise not_ours(path, f"it holds {a(type(state))}, not a dict")
    return state


def unreadable(path: Path, error: Exception) -> CheckpointError:
    """Why torch.load failed, in our words, not torch's."""
    try:
        kind = file_kind(path)
        name = refused_global(error) or (first_global(path) if kind == NOT_TORCH else None)
    except OSError as failure:
        return CheckpointError(f"checkpoint {str(path)!r} cannot be read: {failure.strerror or failure}")
    if name and torch_lacks(name):
        return written_by_newer_torch(path, name)
    if name or (kind == TORN and "Weights only load failed" in str(error)):
        what = f"code or objects other than plain data{f' ({name})' if name else ''}"
        return UnusableCheckpoint(f"checkpoint {str(path)!r} holds {what}", "refused")
    if kind == TORN:
        return UnusableCheckpoint(f"checkpoint {str(path)!r} is truncated or corrupt")
    return not_ours(path, kind)


def file_kind(path: Path) -> str:
    """TORN, NOT_TORCH or what else the file is, from its first bytes and a zip's contents."""
    with path.open("rb") as f:
        head = f.read(len(LEGACY_HEAD))
    if not head.startswith(b"PK\x03\x04"):  # a zip archive, as torch.save writes
        return TORN if head == LEGACY_HEAD else NOT_TORCH if head else "an empty file"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:  # the list of its contents, at its end, is missing
        return TORN
    return TORN if any(name.endswith("/data.pkl") for name in names) else "a zip archive torch.save did not write"


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle naming a function or class where plain data was expected (its args: the name)."""


class PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: the first function or class named stops it, refused by name."""

    def find_class(self, module: str, name: str):
        raise RefusedGlobal(f"{module}.{name}")


def first_global(path: Path) -> str | None:
    """The first function or class a plain pickle names ('posix.system'), found without running it."""
    try:
        with path.open("rb") as f:
            PlainUnpickler(f).load()
    except RefusedGlobal as error:
        return str(error)
    except Exception:  # noqa: BLE001  no pickle, or cut short: nothing named
        pass
    return None


def load_exported_weights(path: Path) -> dict:
    """export.py's model.safetensors or model.pt."""
    if path.suffix == ".safetensors":
        try:
            return safetensors.torch.load_file(path)
        except Exception as error:  # noqa: BLE001  a truncated or foreign file alike
            problem = f"cannot read {str(path)!r} as safetensors ({one_line(error)})"
            raise UnusableCheckpoint(problem, "export it again") from None
    weights = load_plain(path)
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise UnusableCheckpoint(f"{str(path)!r} holds {name!r}: {a(type(value))}, not a tensor", "export it again")
    return weights


def strip_prefixes(state_dict: dict) -> dict:
    return {PREFIXES.sub("", key): value for key, value in state_dict.items()}


def load_model_weights(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    weights = strip_prefixes(state_dict)
    check_shapes(model, weights, source)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))  # a sharded model's too


def load_weights(model: torch.nn.Module, path: Path, ckpt: dict, optimizer=None, part: str = "model") -> None:
    """A checkpoint's model weights, or a part's set (by its name); `ckpt`: load_checkpoint(path, tensors=False).
    A folder's tensors (and `optimizer` state) each rank reads shard by shard: every rank must call this."""
    if not has_part(path, ckpt, part):
        raise CheckpointError(f"{path} has no {part!r} weights (that part was off when it was saved)")
    if part not in ckpt:
        return folders(path).load_sharded(model, path, optimizer, part)
    load_model_weights(model, ckpt[part], str(path))


def has_part(path: Path, ckpt: dict, part: str) -> bool:
    """Whether a checkpoint file (its weight sets, checked on load), or a folder's metadata, holds `part`."""
    return part in weight_sets(ckpt) if "model" in ckpt else folders(path).holds(path, part)


def check_shapes(model: torch.nn.Module, saved: dict, source: str) -> None:
    """Name the first weight missing, extra, or of another shape or kind of dtype. `saved`: the weights, or a
    folder's as meta tensors from its metadata (a sharded model's parameters report full shapes)."""
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
    """When to save, which is best, where to resume. Every rank calls its methods."""

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        self.directory = checkpoint_dir(cfg.output_dir)

    def save_if_due(self, state) -> None:
        every = self.cfg.checkpoint.every_steps
        if every and state.step % every == 0:
            self.save(state)

    def save(self, state, val_metrics: dict | None = None) -> None:
        """With an epoch's `val_metrics`, best.pt too if they are the best."""
        state.guard.check(state.scaler)  # never save non-finite weights: stop instead
        is_best = val_metrics is not None and self.is_new_best(state, val_metrics)
        run = {
            "format_version": CHECKPOINT_FORMAT,
            "config": self.cfg.to_dict(),
            "world_size": self.env.world_size,
            "rng": gather_objects_on_main(capture_rng_state()),  # each rank's, for an exact resume; None off rank 0
        }
        keep_last = self.cfg.checkpoint.keep_last
        try:
            if any(part.saves_sharded for part in state.parts):  # folders on any number of processes: one kind per run
                return folders(self.directory).save_folder(self, state, {**state.run_state_dict(), **run}, is_best)
            with stop_all_if_any_fails(self.device):
                if is_main():
                    save_checkpoint({**state.state_dict(), **run}, self.directory, state.step, keep_last, is_best)
        except UsageError as error:
            raise CheckpointError(
                f"checkpoint not saved ({error}); free disk space or choose a writable output_dir "
                "(earlier checkpoints are intact)"
            ) from None

    def last_good(self) -> str:
        """Which checkpoint a run that stops now leaves."""
        steps = step_checkpoints(self.directory)
        if not steps:
            return "no checkpoint was saved before it"
        return f"the last good checkpoint is {self.directory / 'last.pt'} (step {step_of(steps[-1])}), kept"

    def check_best_metric(self, val_metrics: dict) -> None:
        name = self.cfg.checkpoint.best_metric
        if name not in val_metrics:
            known = ", ".join(key for key in val_metrics if "val_" in key)
            raise CheckpointError(
                f"checkpoint.best_metric is {name!r}, which this task does not report (it reports {known}); "
                "set checkpoint.best_metric to one of them"
            )

    def is_new_best(self, state, val_metrics: dict) -> bool:
        """Whether `val_metrics` beat the best so far (then recorded)."""
        self.check_best_metric(val_metrics)
        value, best = val_metrics[self.cfg.checkpoint.best_metric], state.best_metric_value
        if best is not None and not (value > best if self.cfg.checkpoint.best_mode == "max" else value < best):
            return False
        state.best_metric_value = value
        return True

    def resume(self, state) -> bool:
        """Continue from the run's checkpoint, or init_from's weights; True if the RNG state was restored."""
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
                for part in state.parts:
                    part.after_load(state, Path(init_from), ckpt, resumed=False)  # e.g. an average starts from them
                if is_main():
                    log(f"initialised model weights from {init_from} (fine-tuning)")
            return False
        path, ckpt = found
        refuse_changed_settings(path, ckpt["config"], self.cfg)
        # An epoch's end counts as that epoch (e.g. for which parameters were frozen).
        trained_epoch = ckpt["epoch"] - 1 if ckpt["batches_done"] == 0 and ckpt["epoch"] > 0 else ckpt["epoch"]
        for part in state.parts:
            part.before_load(state, trained_epoch)
        load_weights(state.model, path, ckpt, state.optimizer)
        for part in state.parts:
            part.after_load(state, path, ckpt, resumed=True)  # e.g. a second set of weights
        run_lr = state.scheduler.base_lrs[0]  # this run's, before the checkpoint's replaces it
        state.load_state_dict(ckpt)
        if is_main():
            log(f"resumed from {path}: epoch {state.epoch}, step {state.step}")
        return self.continue_data_position(state, ckpt, run_lr)

    def continue_data_position(self, state, ckpt: dict, run_lr: float) -> bool:
        """Restore this rank's RNG state if the layout is the same (True), else continue at the same sample."""
        saved_lr, train, world_size = state.scheduler.base_lrs[0], self.cfg.train, self.env.world_size
        if is_main() and (not math.isclose(saved_lr, run_lr) or ckpt["config"].get("optim") != plain(self.cfg.optim)):
            log(f"note: the optimizer continues with the checkpoint's lr ({saved_lr:.4g}) and settings")
        if state.batches_done == 0:
            return False
        saved = ckpt["config"].get("train", {})
        batch, accum = (saved.get(key, field_default(TrainConfig.__dataclass_fields__[key])) for key in SHAPE)
        if (ckpt["world_size"], batch, accum) == (world_size, train.batch_size, train.accum_steps):
            restore_rng_state(ckpt["rng"][self.env.rank])
            return True
        samples_done = state.batches_done * batch * ckpt["world_size"]
        state.batches_done = samples_done // effective_batch(train, world_size) * train.accum_steps
        if is_main():
            log(
                f"note: the checkpoint was written by {ckpt['world_size']} processes x batch {batch} x "
                f"{accum} accum_steps and this run has {world_size} x {train.batch_size} x "
                f"{train.accum_steps}; model and optimizer continue exactly, the data order from here differs"
            )
        return False


def load_resume_checkpoint(cfg: Config) -> tuple[Path, dict] | None:
    """auto: last.pt, else the newest usable step; a last.pt train.py did not leave would overwrite newer ones."""
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume != "auto":
        return Path(cfg.checkpoint.resume), load_checkpoint(cfg.checkpoint.resume, tensors=False)
    directory = checkpoint_dir(cfg.output_dir)
    last = directory / "last.pt"
    target = os.readlink(last) if last.is_symlink() else None  # train.py links only to a step-*.dcp folder beside it
    if target is not None and not (STEP_FILE.match(target) and target.endswith(".dcp")):
        raise CheckpointError(
            f"checkpoint {str(last)!r} links to {target!r}, not to a step-*.dcp folder beside it; {CONTINUE_HOW}"
        )
    steps = [p for p in reversed(step_checkpoints(directory)) if not (last.exists() and os.path.samefile(p, last))]
    candidates = ([last] if os.path.lexists(last) else []) + steps  # a broken link is there: said, not skipped
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, tensors=False)
        except CheckpointError as error:
            if is_main():
                log(f"warning: {getattr(error, 'problem', error)}; trying an older checkpoint")
            continue
        newer = [step for step in steps if step_of(step) > ckpt["step"]] if path == last else []
        if newer:
            problem = f"checkpoint {str(last)!r} is step {ckpt['step']}, but {newer[0].name} beside it is newer"
            raise CheckpointError(f"{problem}; {CONTINUE_HOW}")
        return path, ckpt
    if candidates:
        raise CheckpointError(
            f"no readable checkpoint in {str(directory)!r}; move it away to start over, or set checkpoint.resume=PATH"
        )
    return None


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """'section.key: old -> new' for the settings that change what the weights mean; new keys (as defaults) last."""
    fixed = [name for name, section in cfg.sections.items() if getattr(section, "fixed_on_resume", False)]
    changes = section_changes("", saved, cfg, only=("seed",))
    for name in ("data", "model", *fixed):  # and the parts' sections that say so
        changes += section_changes(f"{name}.", saved.get(name) or {}, getattr(cfg, name))
    return [text for _, text in sorted(changes, key=lambda change: change[0])]  # stable: schema order


def section_changes(prefix: str, saved: dict, section, only=None, new_key=False) -> list[tuple[bool, str]]:
    """(new key?, 'name: old -> new') for a config section's changes from `saved`."""
    changes = []
    for f in dataclasses.fields(section):
        if f.name in getattr(section, "may_change_on_resume", ()) or (only is not None and f.name not in only):
            continue
        name, new, is_new = f"{prefix}{f.name}", getattr(section, f.name), new_key or f.name not in saved
        old = field_default(f) if f.name not in saved else saved[f.name]  # a new key's default (MISSING if none)
        if dataclasses.is_dataclass(new) and isinstance(old, dict | type(new)):
            changes += section_changes(f"{name}.", old if isinstance(old, dict) else plain(old), new, new_key=is_new)
        elif plain(old) != plain(new):
            was = repr(plain(old))
            if is_new:
                was = "new key, no default" if old is dataclasses.MISSING else f"new key, default {was}"
            changes.append((is_new, f"{name}: {was} -> {plain(new)!r}"))
    return changes


def refuse_changed_settings(path: Path, saved: dict, cfg: Config) -> None:
    changes = config_changes(saved, cfg)
    if changes:
        raise CheckpointError(
            f"{path} was trained with other settings ({changes[0]}"
            f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); use a new output_dir, "
            f"or checkpoint.resume=none checkpoint.init_from={path} to start from its weights only"
        )
