"""Appending to the run's JSON-lines files without ever leaving a torn line.

A row is appended with one write; if that fails part-way (a full disk, a file-size
limit), the file is cut back to where it ended, so it always holds whole rows. A row
torn anyway (a machine that lost power mid-write) is moved aside when the file is
next opened, never appended to.
"""

import json
import os
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


def not_written(path: Path, error: OSError) -> UsageError:
    return UsageError(
        f"cannot write {str(path)!r}: {error.strerror or error}; free disk space or choose another "
        "output_dir, then run the same command to continue"
    )


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
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with set_aside.open("a") as f:  # first: a failure here leaves the original intact
            f.write("".join(line + "\n" for line in moved))
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise not_written(Path(error.filename or path), error) from None
    return len(moved)
