"""Sharded checkpoints with torch.distributed.checkpoint (DCP), the FSDP part's: every
rank writes and reads only its own shards of the model, the optimizer and the parts'
weights, and DCP reshards on load (another number of processes, DDP or one process).

  step-00001234.dcp/ one folder per save: each rank writes its own shards, rank 0 adds
                     .metadata and run_state.pt (schedule, counters, config, every rank's
                     RNG state); no rank ever holds the full state
last.pt and best.pt are relative symbolic links to a folder (one cannot be hard-linked),
and pruning spares the folders they point to. A folder is written to
'.step-N.dcp.tmp' by every rank and renamed by rank 0 only after every rank's shards,
the metadata and run_state.pt are on disk; it is never replaced: a step saved again gets
the next free name, step-N.1.dcp. engine/checkpoint.py finds this module through the
part's FOLDERS and calls read_checkpoint, read_model_weights, holds, load_into and
save_folder.

Reading runs no code from the files. DCP's FileSystemReader unpickles `.metadata` with a
plain `pickle.load`, and its default planner loads non-tensor items (the optimizer's
param_groups) with `torch.load(weights_only=False)`. `SafeReader` unpickles the metadata
allowing DCP's own metadata classes only, and reads every non-tensor item with the
weights-only unpickler before any planner sees it. Tensors DCP already reads weights-only.
"""

import errno
import io
import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from engine.checkpoint import (
    UnusableCheckpoint,
    atomic_write,
    check_contents,
    check_shapes,
    fsync_dir,
    load_plain,
    not_ours,
    one_line,
    prune,
    refused_global,
    remove,
    torch_lacks,
    write_failed,
    written_by_newer_torch,
)
from engine.distributed import is_main, stop_all_if_any_fails
from engine.errors import CheckpointError

METADATA_FILE = ".metadata"
RUN_STATE = "run_state.pt"  # in a checkpoint folder: all but the model's, the optimizer's and the parts' tensors

# Everything a `.metadata` file of DCP's file system writer refers to (torch 2.x).
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when saved with a Path
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle that names a function or class outside the allowed ones."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata objects and nothing else: any other global (a function a
    hostile file would call) is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        constant = vars(torch).get(name) if module == "torch" else None  # no lazy import of torch's submodules
        if isinstance(constant, TORCH_CONSTANTS):
            return constant  # dtypes such as torch.float32
        raise RefusedGlobal(f"{module}.{name}")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP metadata file, unpickled safely, whose shard files are all there and whole;
    CheckpointError (one line) otherwise."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except RefusedGlobal as error:
        if torch_lacks(str(error)):
            raise written_by_newer_torch(path, str(error)) from None
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} holds code ({error})", "refused") from None
    except FileNotFoundError:
        raise UnusableCheckpoint(f"checkpoint {str(path.parent)!r} is incomplete: it has no {path.name}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {error.strerror or error}") from None
    except Exception:  # noqa: BLE001  truncated or garbage: any unpickling error
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is truncated or corrupt") from None
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(metadata.storage_data or {}, dict)
    ):
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is not DCP metadata")
    check_storage(metadata, path)
    check_shard_files(metadata, path.parent)
    return metadata


def check_storage(metadata: Metadata, path: Path) -> None:
    """Every entry in a file of the folder itself, stored as written (no transforms such as
    compression): a hostile metadata file could otherwise have a load read any file on
    the machine, or inflate a small one."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", "")
        if not isinstance(name, str) or name != Path(name).name or name.startswith("."):
            raise CheckpointError(f"checkpoint {str(path)!r} points outside its folder ({name!r}); refused")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {str(path)!r} stores transformed data, which this project never writes")
        if not all(isinstance(getattr(info, key, None), int) for key in ("offset", "length")):
            raise UnusableCheckpoint(f"checkpoint {str(path)!r} is not DCP metadata")


def check_shard_files(metadata: Metadata, folder: Path) -> None:
    """Every shard file the metadata lists is there and reaches its last item's end: a
    file cut short or lost (a copy or a disk) is said here, in one line and alike on every
    rank, before DCP reads it (on several processes a short read can abort the process).
    One stat per file, whatever the checkpoint's size."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise UnusableCheckpoint(f"checkpoint {str(folder)!r} is incomplete: it has no {name}") from None
        except OSError as error:
            raise CheckpointError(f"checkpoint {str(folder / name)!r} cannot be read: {error.strerror}") from None
        if size < end:
            raise UnusableCheckpoint(f"checkpoint {str(folder)!r} is truncated: {name} has {size} of its {end} bytes")


class SafeReader(FileSystemReader):
    """DCP's file system reader that runs no code from the checkpoint (module docstring)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, WeightsOnlyBytes(planner, str(self.path)))


class WeightsOnlyBytes:
    """A load planner whose non-tensor items were first read by torch's weights-only
    unpickler: what reaches the real planner is plain data, saved again by us."""

    def __init__(self, planner, path: str):
        self.planner, self.path = planner, path

    def __getattr__(self, name: str):
        return getattr(self.planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001  the unpickler's refusal, or a torn item
            raise CheckpointError(
                f"checkpoint {self.path!r} holds code or unreadable data in {read_item.dest_index.fqn!r}; "
                f"refused ({refused_global(error) or one_line(error)})"
            ) from None
        clean = io.BytesIO()
        torch.save(plain, clean)
        clean.seek(0)
        self.planner.load_bytes(read_item, clean)


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of the model and optimizer (plain tensors when not sharded).
    Every rank must call this."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_sharded(state_dict: dict, directory: Path, shown: Path) -> None:
    """Every rank writes its shards into `directory`; rank 0 writes `.metadata` after all
    have written. If any rank fails, every rank raises CheckpointError naming `shown` (the
    checkpoint's final name). Every rank must call this."""
    try:
        dcp.save(state_dict, storage_writer=FileSystemWriter(str(directory), sync_files=True))
    except CheckpointException as error:
        failure = first_failure(error)
        if "unexpected pos" in str(failure) and disk_full(directory.parent):
            failure = os.strerror(errno.ENOSPC)  # torch's writer saw a write cut short by the full disk
        raise CheckpointError(f"cannot write {str(shown)!r}: {failure}") from None


def disk_full(directory: Path) -> bool:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < 64 * 2**10


def load_sharded(
    model: torch.nn.Module, directory: Path, optimizer: torch.optim.Optimizer | None = None, part: str = "model"
) -> None:
    """Load a sharded checkpoint's `part` ("model", or "ema": the average of the weights)
    into the model, and the optimizer when given (without one, the optimizer's shards are
    never read), each rank reading only what it holds. Every rank must call this."""
    read_metadata(directory / METADATA_FILE)  # DCP would take a refusal for a missing file and go on
    state_dict = {part: get_model_state_dict(model)}
    if optimizer is not None:  # its entry initialises the optimizer's state, to be filled in place
        state_dict["optimizer"] = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.load(state_dict, storage_reader=SafeReader(str(directory)))
    except CheckpointException as error:
        raise load_error(directory, error) from None
    set_model_state_dict(model, state_dict[part])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state_dict["optimizer"])


def load_full(directory: Path, keys: set[str] | None = None) -> dict:
    """Every tensor of a sharded checkpoint (or those under the top-level `keys`), whole,
    on this process's CPU, without collectives: one process reads the checkpoint."""
    read_metadata(directory / METADATA_FILE)  # DCP would take a refusal for a missing file and go on
    state_dict: dict = {}
    try:
        _load_state_dict(
            state_dict,
            storage_reader=SafeReader(str(directory)),
            planner=_EmptyStateDictLoadPlanner(keys=keys),
            no_dist=True,
        )
    except CheckpointException as error:
        raise load_error(directory, error) from None
    return state_dict


def model_shapes(metadata: Metadata, part: str = "model") -> dict[str, torch.Tensor]:
    """The model weights' (or `part`'s) names, full shapes and dtypes, from the metadata
    alone: as tensors on the meta device, which hold no data."""
    prefix = f"{part}."
    return {
        key[len(prefix) :]: torch.empty(tuple(value.size), dtype=value.properties.dtype, device="meta")
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(value, "size")
    }


def load_error(directory: Path, error: CheckpointException) -> CheckpointError:
    """Our own refusal as it was raised, or the first rank's reason in one line."""
    failure = first_failure(error)
    if isinstance(failure, CheckpointError):
        return failure
    return CheckpointError(f"checkpoint {str(directory)!r} cannot be loaded: {failure}")


def first_failure(error: CheckpointException) -> str | CheckpointError:
    """The first rank's reason from DCP's collected failures: our own CheckpointError, or
    one line (an OSError's strerror such as "No space left on device")."""
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
        if isinstance(failure, CheckpointError):
            return failure
        if isinstance(failure, OSError) and failure.strerror:
            return failure.strerror
        return one_line(failure)
    return one_line(error)


def unused_folder_name(directory: Path, step: int) -> Path:
    """step-N.dcp, or step-N.1.dcp, step-N.2.dcp... when the step was saved before (e.g. at
    an epoch's end after a step checkpoint): a published folder is never replaced, so
    last.pt and best.pt never point at a folder being rewritten."""
    final, revision = directory / f"step-{step:08d}.dcp", 0
    while os.path.lexists(final):
        revision += 1
        final = directory / f"step-{step:08d}.{revision}.dcp"
    return final


def commit_folder(tmp: Path, final: Path) -> None:
    """Rename a completely written checkpoint folder to its unused final name."""
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def publish_link(folder: Path, target: Path) -> None:
    """Point `target` (last.pt, best.pt) at a checkpoint folder, atomically."""
    tmp = target.with_name(f".{target.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(folder.name, tmp)  # relative: the checkpoints folder may be moved or mounted elsewhere
    os.replace(tmp, target)
    fsync_dir(target.parent)


def read_checkpoint(path: Path, tensors: bool) -> dict:
    """A checkpoint folder's run state, checked as load_checkpoint checks a file; with
    `tensors`, every tensor too, whole, on this process's CPU."""
    if not any((path / name).exists() for name in (METADATA_FILE, RUN_STATE)):
        raise not_ours(path, "a folder without .metadata or run_state.pt")
    metadata = read_metadata(path / METADATA_FILE)  # refuses a hostile or torn folder before anything else is read
    if not (path / RUN_STATE).is_file():
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is incomplete: it has no {RUN_STATE}")
    state = load_plain(path / RUN_STATE)
    check_contents(path, state, tensors_inside=False)
    check_sharded_weights(path, metadata)
    return {**state, **load_full(path)} if tensors else state


def check_sharded_weights(path: Path, metadata: Metadata) -> None:
    """A sharded folder's model weights, as its metadata lists them: there, and tensors."""
    weights = {key: value for key, value in metadata.state_dict_metadata.items() if key.startswith("model.")}
    if not weights:
        raise not_ours(path, "no 'model' in its .metadata")
    for key, value in weights.items():
        if not isinstance(value, TensorStorageMetadata):
            raise not_ours(path, f"'model' holds {key.removeprefix('model.')!r}: not a tensor")


def read_model_weights(path: Path) -> dict:
    """A checkpoint folder's model weights, whole, on the CPU; the optimizer state is not read."""
    read_checkpoint(path, tensors=False)  # refuses what is not a checkpoint of this project
    return load_full(path, keys={"model"})["model"]


def holds(path: Path, part: str) -> bool:
    """Whether a checkpoint folder's metadata lists `part`'s weights ("model", "ema")."""
    return any(key.startswith(f"{part}.") for key in read_metadata(path / METADATA_FILE).state_dict_metadata)


def load_into(model: torch.nn.Module, path: Path, optimizer=None, part: str = "model") -> None:
    """A checkpoint folder's `part` weights (and the optimizer's state, when given), each
    rank reading its own shards, resharded to this run's processes. Every rank must call this."""
    check_shapes(model, model_shapes(read_metadata(path / METADATA_FILE), part), str(path))
    load_sharded(model, path, optimizer, part)


def save_folder(checkpointer, state, run_state: dict, is_best: bool) -> None:
    """Every rank writes its shards of the model, the optimizer and the parts' weights
    into a temporary folder; rank 0 adds run_state.pt and renames the folder into place
    only when all of it is on disk. Every rank must call this."""
    directory = checkpointer.directory
    final = directory / f"step-{state.step:08d}.dcp"  # its name in messages
    tmp = directory / f".{final.name}.tmp"
    with stop_all_if_any_fails(checkpointer.device):
        if is_main():
            directory.mkdir(parents=True, exist_ok=True)
            remove(tmp)  # left by a save killed midway
    shards = sharded_state_dict(state.model, state.optimizer)
{%- if cookiecutter.ema %}
    shards |= {part.name: part.weights() for part in state.parts if part.holds_weights}
{%- endif %}
    try:
        save_sharded(shards, tmp, final)  # raises on every rank alike
        with stop_all_if_any_fails(checkpointer.device):
            if is_main():
                finish_folder(tmp, state.step, run_state, is_best, checkpointer.cfg.checkpoint.keep_last)
    except BaseException:
        if is_main():
            remove(tmp)  # every rank has stopped writing into it
        raise


def finish_folder(tmp: Path, step: int, run_state: dict, is_best: bool, keep_last: int) -> None:
    directory = tmp.parent
    final = unused_folder_name(directory, step)
    try:
        atomic_write(tmp, RUN_STATE, lambda f: torch.save(run_state, f))
        commit_folder(tmp, final)
        publish_link(final, directory / "last.pt")
        if is_best:
            publish_link(final, directory / "best.pt")
        prune(directory, keep_last)
    except (OSError, RuntimeError) as error:
        raise write_failed(final, error) from None
