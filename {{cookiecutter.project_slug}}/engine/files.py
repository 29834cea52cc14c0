"""Writing files without ever leaving a torn one, and naming the file when the disk refuses."""

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import UsageError

CONTINUE_ELSEWHERE = "another output_dir, then run the same command to continue"


def not_written(path: Path, error: OSError, instead: str = CONTINUE_ELSEWHERE) -> UsageError:
    """The one line for a file that could not be written (a full disk, a read-only folder)."""
    return UsageError(f"cannot write {str(path)!r}: {error.strerror or error}; free disk space or choose {instead}")


def append_json_line(path: Path, row: dict) -> None:
    append_whole(path, json.dumps(row) + "\n")


def append_whole(path: Path, text: str) -> None:
    """Append `text` with one write; a failure leaves the file as it was and names it."""
    data = text.encode()
    try:
        with path.open("ab", buffering=0) as f:
            size = f.tell()
            try:
                if f.write(data) != len(data):  # a short write: the disk filled up mid-row
                    raise OSError(28, os.strerror(28))  # ENOSPC
            except OSError:
                f.truncate(size)  # whole rows only
                raise
    except OSError as error:
        raise not_written(path, error) from None


def write_text_whole(path: Path, text: str) -> None:
    try:
        atomic_write(path.parent, path.name, lambda f: f.write(text.encode()))
    except OSError as error:
        raise not_written(path, error) from None


def rewind_json_lines(path: Path, keep, set_aside: Path) -> int:
    """Keep the rows for which `keep(row)` is true; move the others and any torn line to `set_aside`."""
    kept, moved = [], []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        (kept if isinstance(row, dict) and keep(row) else moved).append(line)
    if not moved:
        return 0
    append_whole(set_aside, "".join(line + "\n" for line in moved))  # first: a failure leaves the original intact
    write_text_whole(path, "".join(line + "\n" for line in kept))
    return len(moved)


def already_exists(path: Path) -> UsageError:
    return UsageError(f"{str(path)!r} already exists; choose another --out or remove it first")


def write_new_file(path: Path, write) -> None:
    try:
        create_whole(path, write)
    except FileExistsError:
        raise already_exists(path) from None


def create_whole(path: Path, write) -> None:
    """Create `path` from `write(file)`, whole or not at all, never replacing what is there (FileExistsError)."""
    tmp, made = write_temporary(path.parent, path.name, write), False
    try:
        try:
            os.link(tmp, path)
            made = True
        except FileExistsError:  # anything there is left alone
            raise
        except OSError:  # a file system without hard links: created exclusively, then copied
            with tmp.open("rb") as source, open_new(path, "wb") as copy:
                made = True
                shutil.copyfileobj(source, copy)
                copy.flush()
                os.fsync(copy.fileno())
        fsync_dir(path.parent)
    except BaseException:
        if made:  # not known to last: not made
            path.unlink(missing_ok=True)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def open_new(path: Path, mode: str = "w"):
    """`path` opened for writing, created by this call: never one that exists, nor through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # less the umask
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def private_folder(beside: Path) -> Path:
    """A new hidden folder beside `beside`, of a name no other run can know."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp")
    os.chmod(folder, 0o777 & ~umask())  # mkdtemp's 0700: the finished folder is shared as any other
    return Path(folder)


def umask() -> int:
    """The process's umask, read without setting it where Linux tells it (setting it is process-wide)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(directory: Path, name: str, write) -> None:
    """Replace `directory / name` with what `write(file)` writes: a crash leaves the old or the new file."""
    tmp = write_temporary(directory, name, write)
    try:
        os.replace(tmp, directory / name)
    finally:
        tmp.unlink(missing_ok=True)  # the rename failed (renamed: nothing there)
    fsync_dir(directory)


def write_temporary(directory: Path, name: str, write) -> Path:
    """A new, fsynced '.<name>.pid<pid>.*.tmp' file from `write(file)`; its random name follows no planted link,
    its pid tells a leftover from another live process's file."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.pid{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would hide the file from a group sharing the folder
        with os.fdopen(fd, "wb") as f:
            recorder = WriteErrors(f)
            try:
                write(recorder)
            except RuntimeError as error:  # e.g. "No space left on device", not torch's "unexpected pos"
                raise (recorder.error or error) from None
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


class WriteErrors:
    """Keeps its writes' first error: torch.save turns a full disk into RuntimeError("unexpected pos N vs M")."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except BaseException as error:  # OSError, or KeyboardInterrupt from a second Ctrl-C
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
