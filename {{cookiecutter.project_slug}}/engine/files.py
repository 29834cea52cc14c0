"""Writing the run's small files (the resolved config, metrics.jsonl) without ever
leaving a torn one, and naming the file when the disk refuses.

A file is replaced whole: written beside its name, then renamed over it.

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


def write_text_whole(path: Path, text: str) -> None:
    """Replace `path` with `text`: the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise not_written(path, error) from None


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
    try:
        with set_aside.open("a") as f:  # first: a failure here leaves the original intact
            f.write("".join(line + "\n" for line in moved))
    except OSError as error:
        raise not_written(set_aside, error) from None
    write_text_whole(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(moved)
