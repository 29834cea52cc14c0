"""Writing files without ever leaving a torn one, and naming the file when the disk refuses.

A file is replaced whole: written beside its name, then renamed over it (`atomic_write`).
An output a user names (--out) is created, never replaced (`create_whole`): written to a
temporary of a name no other run can know, then hard-linked to its name, which fails if
anything is there by then (another run's file, or a planted link). A row is appended with
one write, cut back if that fails part-way (a full disk), so the file holds whole rows; a
row torn anyway (a power loss) is moved aside when the file is next opened.
"""

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
    """Append `row` as one JSON line; a failure leaves the file as it was and names it."""
    data = (json.dumps(row) + "\n").encode()
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
    """Replace `path` with `text`: the old file or the new one, never a torn one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path.parent, path.name, lambda f: f.write(text.encode()))
    except OSError as error:
        raise not_written(path, error) from None


def rewind_json_lines(path: Path, keep, set_aside: Path) -> int:
    """Keep the rows for which `keep(row)` is true; move the others, and any line that is no
    whole JSON row (torn or edited), to the end of `set_aside`. Returns how many moved."""
    kept, moved = [], []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        (kept if isinstance(row, dict) and keep(row) else moved).append(line)
    if not moved:
        return 0
    try:
        with set_aside.open("a") as f:  # first: a failure here leaves the original intact
            f.write("".join(line + "\n" for line in moved))
    except OSError as error:
        raise not_written(set_aside, error) from None
    write_text_whole(path, "".join(line + "\n" for line in kept))
    return len(moved)


def already_exists(path: Path) -> UsageError:
    return UsageError(f"{str(path)!r} already exists; choose another --out or remove it first")


def write_new_file(path: Path, write) -> None:
    """`create_whole`, refusing in one line (`already_exists`) if anything is at `path`."""
    try:
        create_whole(path, write)
    except FileExistsError:
        raise already_exists(path) from None


def create_whole(path: Path, write) -> None:
    """Create `path` holding what `write(file)` writes, complete or not at all, never
    following or replacing what is there by then (FileExistsError)."""
    tmp = write_temporary(path.parent, path.name, write)
    try:
        try:
            os.link(tmp, path)
            copy = None
        except FileExistsError:  # anything there is left alone
            raise
        except OSError:  # a file system without hard links: created exclusively, then copied
            copy = open_new(path, "wb")
        try:
            if copy is not None:
                with copy, tmp.open("rb") as source:
                    shutil.copyfileobj(source, copy)
                    copy.flush()
                    os.fsync(copy.fileno())
            fsync_dir(path.parent)
        except BaseException:  # not known to last: not made
            path.unlink(missing_ok=True)
            raise
    finally:
        tmp.unlink(missing_ok=True)


def open_new(path: Path, mode: str = "w"):
    """`path` opened for writing, created by this call: never one that exists, nor through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def private_folder(beside: Path) -> Path:
    """A new hidden folder beside `beside`, of a name no other run can know."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))


def atomic_write(directory: Path, name: str, write) -> None:
    """Write via a temporary file, rename it into place, fsync the folder: a crash at any
    point leaves the old file or the complete new one."""
    tmp = write_temporary(directory, name, write)
    try:
        os.replace(tmp, directory / name)
    finally:
        tmp.unlink(missing_ok=True)  # the rename failed (renamed: nothing there)
    fsync_dir(directory)


def write_temporary(directory: Path, name: str, write) -> Path:
    """A new, fsynced '.<name>.*.tmp' file (nothing takes it for a checkpoint) holding what
    `write(file)` writes; its name is random and it is created exclusively, so no link
    planted at a name it could have is followed."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            recorder = WriteErrors(f)
            try:
                write(recorder)
            except RuntimeError:
                if recorder.error is None:
                    raise
                raise recorder.error from None  # e.g. "No space left on device", not torch's "unexpected pos"
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


class WriteErrors:
    """A file that keeps the first error of its writes: torch.save reports a failed write
    (a full disk) only as "unexpected pos N vs M", and turns a Ctrl-C that lands in a
    write into the same RuntimeError, which would then blame the disk."""

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
