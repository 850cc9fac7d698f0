"""Write a file so that a reader sees the old content or the new one, never half of one.

The one home for whole-file writes of the project's modules and host code (verify records, secrets
files, the vLLM unit's inputs, fstab, the converter's index and shards, caches and manifests): a
temporary file in the same folder, fsynced, renamed over the target, and, where a crash must not
lose the rename, the folder fsynced. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the folder's entries (a rename, a new or removed name) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temp: str | os.PathLike, path: str | os.PathLike, sync_dir: bool = True) -> None:
    """A temporary file written elsewhere (not yet fsynced) becomes `path`: fsync it, rename it over
    `path`, then fsync the folder."""
    fd = os.open(temp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(os.fspath(path)) or ".")


def write_atomically(path: str | os.PathLike, content: str | bytes, mode: int | None = None,
                     owner_root: bool = False, *, owner: tuple[int, int] | None = None,
                     temp: str | os.PathLike | None = None, make_dirs: bool = False, sync_dir: bool = False,
                     check: Callable[[str], None] | None = None) -> None:
    """`content` (text as UTF-8, or bytes) into `path` via a temporary file in the same folder, fsynced
    and renamed over it.

    mode and owner (owner_root: root:root) are set on the temporary file before a byte is written, so
    a secret is never readable; without a mode the file keeps the temporary file's: 0600 from mkstemp,
    or 0666 less the umask for a named `temp` (created exclusively, e.g. ``.NAME.tmp-PID`` that a later
    run can recognise). make_dirs creates the folder; check(temp path) runs after the fsync and before
    the rename (an exception leaves `path` as it was); sync_dir fsyncs the folder after the rename.
    The temporary file is removed on any failure."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    if make_dirs:
        os.makedirs(directory, exist_ok=True)
    if temp is None:
        handle, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    else:
        tmp = os.fspath(temp)
        handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if mode is not None:
            os.fchmod(handle, mode)
        if owner_root:
            owner = (0, 0)
        if owner is not None:
            os.fchown(handle, *owner)
        data = content.encode("utf-8") if isinstance(content, str) else content
        with os.fdopen(handle, "wb") as stream:
            handle = -1
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        if handle >= 0:
            os.close(handle)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(directory)
