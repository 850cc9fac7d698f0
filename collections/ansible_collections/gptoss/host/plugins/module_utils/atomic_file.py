"""Write a file so that a reader sees the old content or the new one, never half of one.

One home for the project's modules that write whole files (verify records, secrets files). Standard
library only.
"""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, text: str, mode: int, owner_root: bool = False) -> None:
    """`text` into `path` via a temporary file in the same folder, renamed over it. The mode (and,
    with owner_root, root:root) is set before a byte is written, so a secret is never readable."""
    directory = os.path.dirname(path) or "."
    handle, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        os.fchmod(handle, mode)
        if owner_root:
            os.fchown(handle, 0, 0)
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
