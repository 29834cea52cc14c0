"""Writing files without ever leaving a torn one, and naming the file when the disk refuses.

A file is replaced whole: written beside its name, then renamed over it (atomic_write,
for checkpoints; write_text_whole, for the run's small files).

An output a user names (predict.py's and export.py's --out) is created, never replaced
(write_new_file): written to a temporary file of a name no other run can know, created
exclusively (so never through a link planted there), then hard-linked to its name, which
fails if anything is there by then (another run's file, or a link).

A row is appended with one write; if that fails part-way (a full disk, a file-size
limit), the file is cut back to where it ended, so it always holds whole rows. A row
torn anyway (a machine that lost power mid-write) is moved aside when the file is
next opened, never appended to.
"""

import json
import os
import tempfile
from pathlib import Path

from engine.errors import UsageError


def append_json_line(path: Path, row: dict) -> None:
    """Append `row` as one JSON line; a failure leaves the file as it was and names it."""
    data = (json.dumps(row) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise not_written(path, error) from None
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):  # a short write: the disk filled up mid-row
                raise OSError(28, os.strerror(28))  # ENOSPC
        except OSError as error:
            os.ftruncate(fd, size)  # whole rows only
            raise not_written(path, error) from None
    finally:
        os.close(fd)


def write_text_whole(path: Path, text: str) -> None:
    """Replace `path` with `text`: the old file or the new one, never a torn one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path.parent, path.name, lambda f: f.write(text.encode()))
    except OSError as error:
        raise not_written(path, error) from None


CONTINUE_ELSEWHERE = "another output_dir, then run the same command to continue"


def not_written(path: Path, error: OSError, instead: str = CONTINUE_ELSEWHERE) -> UsageError:
    """The one line for a file that could not be written (a full disk, a read-only folder)."""
    return UsageError(f"cannot write {str(path)!r}: {error.strerror or error}; free disk space or choose {instead}")


def read_json_lines(path: Path) -> tuple[list[dict], list[str]]:
    """The file's rows, and its lines that are not whole JSON rows (torn or edited)."""
    rows, bad = [], []
    if not path.exists():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(line)
    return rows, bad


def rewind_json_lines(path: Path, keep, set_aside: Path) -> int:
    """Keep the rows for which `keep(row)` is true; move the others, and any torn line,
    to the end of `set_aside` (nothing is deleted). Returns how many were moved."""
    rows, bad = read_json_lines(path)
    kept = [row for row in rows if keep(row)]
    moved = [json.dumps(row) for row in rows if not keep(row)] + bad
    if not moved:
        return 0
    try:
        with set_aside.open("a") as f:  # first: a failure here leaves the original intact
            f.write("".join(line + "\n" for line in moved))
    except OSError as error:
        raise not_written(set_aside, error) from None
    write_text_whole(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(moved)


def already_exists(path: Path) -> UsageError:
    return UsageError(f"{str(path)!r} already exists; choose another --out or remove it first")


def write_new_file(path: Path, write) -> None:
    """Create `path` holding what `write(file)` writes, complete or not at all; if anything
    is at `path` by then (a file, a link), it is left alone: `already_exists`. Other
    failures (a full disk) raise their OSError."""
    try:
        create_whole(path, write)
    except FileExistsError:
        raise already_exists(path) from None


def create_whole(path: Path, write) -> None:
    """The one way this project creates a file that must not exist yet: written to a
    temporary of a random name, then linked into place, which never follows or replaces
    what is at `path` (FileExistsError). Complete or not at all."""
    tmp = write_temporary(path.parent, path.name, write)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:  # anything there is left alone
            raise
        except OSError:  # a file system without hard links: created exclusively, then copied
            copy_to_new(tmp, path)
        try:
            fsync_dir(path.parent)
        except OSError:  # not known to last: not made
            path.unlink(missing_ok=True)
            raise
    finally:
        tmp.unlink(missing_ok=True)


def copy_to_new(source: Path, path: Path) -> None:
    target = open_new(path, "wb")  # FileExistsError if anything is there
    try:
        with target, source.open("rb") as data:
            while chunk := data.read(2**20):
                target.write(chunk)
            target.flush()
            os.fsync(target.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def open_new(path: Path, mode: str = "w"):
    """`path` opened for writing, created by this call: never one that exists, nor
    through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def private_folder(beside: Path) -> Path:
    """A new hidden folder beside `beside`, of a name no other run can know, for the parts
    of an output that are joined into it."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))


def atomic_write(directory: Path, name: str, write) -> None:
    """Write via a temporary file, fsync it, rename it into place, fsync the folder.

    A crash at any point leaves either the old file or the complete new one, never a
    torn one. Temporary names start with '.' and end in '.tmp', so nothing mistakes them
    for checkpoints.
    """
    tmp = write_temporary(directory, name, write)
    try:
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def write_temporary(directory: Path, name: str, write) -> Path:
    """A new, fsynced '.<name>.*.tmp' file in `directory` holding what `write(file)`
    writes; its name is random and it is created exclusively, so no link planted at a
    name it could have is followed."""
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
