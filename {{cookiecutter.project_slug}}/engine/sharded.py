"""Sharded checkpoint folders with torch.distributed.checkpoint (DCP): each rank writes and reads its own
shards, resharded on load. DCP's reader unpickles freely; `SafeReader` runs no code from the files."""

import errno
import io
import os
import pickle
import shutil
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

from engine import checkpoint
from engine.checkpoint import UnusableCheckpoint, not_ours
from engine.distributed import is_main, stop_all_if_any_fails
from engine.errors import CheckpointError
from engine.files import atomic_write, fsync_dir

METADATA_FILE = ".metadata"
RUN_STATE = "run_state.pt"  # in a checkpoint folder: all but the model's, the optimizer's and the parts' tensors
DCP_METADATA = "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties MetadataIndex"
METADATA_GLOBALS = {  # everything a `.metadata` file of DCP's file system writer refers to (torch 2.x)
    *(f"torch.distributed.checkpoint.metadata.{name}" for name in DCP_METADATA.split()),
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",  # a layout by its name
    "pathlib.PosixPath",  # StorageMeta.checkpoint_id when saved with a Path
    "pathlib.PurePosixPath",
    "collections.OrderedDict",
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds plain data, torch's constants and METADATA_GLOBALS only."""

    def find_class(self, module: str, name: str):
        constant = vars(torch).get(name) if module == "torch" else None
        if isinstance(constant, torch.dtype | torch.layout | torch.memory_format):
            return constant
        if f"{module}.{name}" not in METADATA_GLOBALS:
            raise checkpoint.RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    try:
        with path.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except checkpoint.RefusedGlobal as error:
        if checkpoint.torch_lacks(str(error)):
            raise checkpoint.written_by_newer_torch(path, str(error)) from None
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} holds code ({error})", "refused") from None
    except FileNotFoundError:
        raise UnusableCheckpoint(f"checkpoint {str(path.parent)!r} is incomplete: it has no {path.name}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {error.strerror or error}") from None
    except Exception:  # noqa: BLE001  truncated or garbage: any unpickling error
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is truncated or corrupt") from None
    well_formed = isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
    if not (well_formed and isinstance(metadata.storage_data or {}, dict)):
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is not DCP metadata")
    check_storage(metadata.storage_data or {}, path)
    return metadata


def check_storage(storage: dict, path: Path) -> None:
    """Entries only in the folder's own untransformed files, which must be whole: a hostile file could have a
    load read any file or inflate one, and on several processes a short read can abort the process."""
    ends: dict[str, int] = {}
    folder = path.parent
    for info in storage.values():
        name = getattr(info, "relative_path", "")
        if not isinstance(name, str) or name != Path(name).name or name.startswith("."):
            raise CheckpointError(f"checkpoint {str(path)!r} points outside its folder ({name!r}); refused")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {str(path)!r} stores transformed data, which this project never writes")
        if not all(isinstance(getattr(info, key, None), int) for key in ("offset", "length")):
            raise UnusableCheckpoint(f"checkpoint {str(path)!r} is not DCP metadata")
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):  # one stat per file, whatever the checkpoint's size
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise UnusableCheckpoint(f"checkpoint {str(folder)!r} is incomplete: it has no {name}") from None
        except OSError as error:
            raise CheckpointError(f"checkpoint {str(folder / name)!r} cannot be read: {error.strerror}") from None
        if size < end:
            raise UnusableCheckpoint(f"checkpoint {str(folder)!r} is truncated: {name} has {size} of its {end} bytes")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, WeightsOnlyBytes(planner, str(self.path)))


class WeightsOnlyBytes:
    """A load planner whose non-tensor items are first read weights-only, then saved again as plain data."""

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
                f"refused ({checkpoint.refused_global(error) or checkpoint.one_line(error)})"
            ) from None
        clean = io.BytesIO()
        torch.save(plain, clean)
        clean.seek(0)
        self.planner.load_bytes(read_item, clean)


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_sharded(state_dict: dict, directory: Path, shown: Path) -> None:
    """If any rank fails, every rank raises CheckpointError naming `shown`."""
    try:
        dcp.save(state_dict, storage_writer=FileSystemWriter(str(directory), sync_files=True))
    except CheckpointException as error:
        failure = failed(error, f"cannot write {str(shown)!r}")
        if "unexpected pos" in str(failure) and shutil.disk_usage(directory.parent).free < 2**16:  # a full disk cut it
            failure = CheckpointError(f"cannot write {str(shown)!r}: {os.strerror(errno.ENOSPC)}")
        raise failure from None


def load_sharded(
    model: torch.nn.Module, directory: Path, optimizer: torch.optim.Optimizer | None = None, part: str = "model"
) -> None:
    """A folder's `part` weights ("model", "ema") and the optimizer's state if given. Every rank must call this."""
    metadata = read_metadata(directory / METADATA_FILE)  # DCP would take a refusal for a missing file and go on
    shapes = {  # the full shapes and dtypes, as meta tensors (no data)
        key.removeprefix(f"{part}."): torch.empty(tuple(value.size), dtype=value.properties.dtype, device="meta")
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith(f"{part}.") and hasattr(value, "size")
    }
    checkpoint.check_shapes(model, shapes, str(directory))
    state_dict = {part: get_model_state_dict(model)}
    if optimizer is not None:  # its entry initialises the optimizer's state, to be filled in place
        state_dict["optimizer"] = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.load(state_dict, storage_reader=SafeReader(str(directory)))
    except CheckpointException as error:
        raise failed(error, f"checkpoint {str(directory)!r} cannot be loaded") from None
    set_model_state_dict(model, state_dict[part])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state_dict["optimizer"])


def load_full(directory: Path, keys: set[str] | None = None) -> dict:
    """Every tensor of a folder (or under `keys`), whole, on the CPU, without collectives."""
    read_metadata(directory / METADATA_FILE)  # DCP would take a refusal for a missing file and go on
    state_dict: dict = {}
    try:
        planner = _EmptyStateDictLoadPlanner(keys=keys)  # takes what the metadata lists
        _load_state_dict(state_dict, storage_reader=SafeReader(str(directory)), planner=planner, no_dist=True)
    except CheckpointException as error:
        raise failed(error, f"checkpoint {str(directory)!r} cannot be loaded") from None
    return state_dict


def failed(error: CheckpointException, what: str) -> CheckpointError:
    """The first rank's failure: our own refusal as raised, else `what` and one line."""
    failure = next(iter((getattr(error, "failures", None) or {}).values()), error)
    failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
    if isinstance(failure, CheckpointError):
        return failure
    return CheckpointError(f"{what}: {getattr(failure, 'strerror', None) or checkpoint.one_line(failure)}")


def read_checkpoint(path: Path, tensors: bool) -> dict:
    """A folder's run state, checked as load_checkpoint checks a file; with `tensors`, every tensor too."""
    if not any((path / name).exists() for name in (METADATA_FILE, RUN_STATE)):
        raise not_ours(path, "a folder without .metadata or run_state.pt")
    metadata = read_metadata(path / METADATA_FILE)  # refuses a hostile or torn folder before anything else is read
    if not (path / RUN_STATE).is_file():
        raise UnusableCheckpoint(f"checkpoint {str(path)!r} is incomplete: it has no {RUN_STATE}")
    state = checkpoint.load_plain(path / RUN_STATE)
    in_shards = {"model": {}, "optimizer": {}}  # their tensors, checked against .metadata below
    checkpoint.check_contents(path, in_shards | state)
    weights = {key: value for key, value in metadata.state_dict_metadata.items() if key.startswith("model.")}
    if not weights:
        raise not_ours(path, "no 'model' in its .metadata")
    for key, value in weights.items():
        if not isinstance(value, TensorStorageMetadata):
            raise not_ours(path, f"'model' holds {key.removeprefix('model.')!r}: not a tensor")
    return {**state, **load_full(path)} if tensors else state


def holds(path: Path, part: str) -> bool:
    return any(key.startswith(f"{part}.") for key in read_metadata(path / METADATA_FILE).state_dict_metadata)


def save_folder(checkpointer, state, run_state: dict, is_best: bool) -> None:
    """Into a temporary folder, renamed into place once all is on disk. Every rank must call this."""
    directory, keep_last = checkpointer.directory, checkpointer.cfg.checkpoint.keep_last
    tmp = directory / f".step-{state.step:08d}.dcp.tmp"
    with stop_all_if_any_fails(checkpointer.device):
        if is_main():
            directory.mkdir(parents=True, exist_ok=True)
            checkpoint.remove(tmp)  # left by a save killed midway
    shards = sharded_state_dict(state.model, state.optimizer)
    shards |= {part.name: part.weights() for part in state.parts if part.holds_weights}
    final, revision = directory / f"step-{state.step:08d}.dcp", 0
    try:
        save_sharded(shards, tmp, final)  # raises on every rank alike
        with stop_all_if_any_fails(checkpointer.device):
            if is_main():
                while os.path.lexists(final):  # saved at this step before: a published folder is never replaced
                    revision += 1
                    final = directory / f"step-{state.step:08d}.{revision}.dcp"
                checkpoint.publish(final, lambda: commit_folder(tmp, final, run_state), keep_last, is_best)
    except BaseException:
        if is_main():
            checkpoint.remove(tmp)  # every rank has stopped writing into it
        raise


def commit_folder(tmp: Path, final: Path, run_state: dict) -> None:
    atomic_write(tmp, RUN_STATE, lambda f: torch.save(run_state, f))
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
