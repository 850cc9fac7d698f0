"""Convert pytorch_model*.bin / *.pt checkpoints to verified safetensors, shard by shard, atomically.

    python -m service.venv.convert MODEL_DIR [--delete-originals] [--check] [--json] [--no-progress] [--jobs N]

Runs on the target host with the vLLM venv's python (torch + safetensors; no tqdm). See the
"Converter" section of docs/design.md for the protocol. In short:

* Every input shard becomes one output shard ``model-XXXXX-of-YYYYY.safetensors`` (1-based, also for a
  single input), and ``model.safetensors.index.json`` is always written, last and atomically: a model
  counts as converted only once that index exists.
* Each shard is written to ``.NAME.tmp-PID`` in the model directory (tensor bytes copied file to
  file in the kernel with copy_file_range where they lie as-is in the source), re-read and verified
  bit for bit against the source tensors (memcmp), fsynced, renamed into place and the directory
  fsynced. --jobs shards (default: one per usable CPU) go through this at once, each in its own temp file. Errors
  remove the temp files and stop the other jobs; temp files of a killed run are removed at the next
  start; originals are never modified and are deleted only with --delete-originals after every
  shard and the index verified.
* A re-run skips output shards that already exist after verifying them against the source again.
* Tensors sharing one storage with the same view (tied embeddings) are stored once; the other names
  are aliases: mapped to the same file in the index and listed in the shard's ``gptoss_aliases``
  metadata (JSON object alias -> stored name).

Exit codes: 0 success, 1 conversion/validation error, 2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import mmap
import os
import re
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ansible_collections.gptoss.host.plugins.module_utils import atomic_file
from service.host.safetensors_check import (
    INDEX_NAME,
    SafetensorsFormatError,
    SafetensorsHeader,
    TensorEntry,
    aliases_of,
    check_safetensors_dir,
    read_header,
)

# torch is imported where it is used (import time ~1.8 s on the 2-core box): a model that is safetensors
# already is only checked (headers and sizes, stdlib), so a converge on it never pays for torch.
if TYPE_CHECKING:
    import torch

CONVERTER_ID = "gptoss-convert"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
SOURCE_GLOBS = ("pytorch_model*.bin", "*.pt")
WRITE_CHUNK = 64 * 1024 * 1024
VERIFY_CHUNK = 16 * 1024 * 1024
# Headroom beyond the bytes the output shards will hold: headers, the index, filesystem slack.
SPACE_MARGIN_BYTES = 8 * 1024 * 1024
SPACE_MARGIN_FRACTION = 0.01
# Test hook: when set to an event name the process prints "stop-point: EVENT" and SIGSTOPs itself,
# so tests can kill it (or fill the disk) at an exact point. Events: "after-space-check",
# "partial:N" (shard N's temp file is half written).
STOP_AT_ENV = "GPTOSS_CONVERT_STOP_AT"
TEMP_RE = re.compile(r"^\..+\.tmp-(\d+)$")
ZIP_MAGIC = b"PK\x03\x04"
MADV_DONTNEED = 4
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# copy_file_range errors meaning "not here" (old kernel, other file system, no support): fall back to write().
COPY_RANGE_UNSUPPORTED = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}

# safetensors' dtype names by torch's (str(dtype) without "torch."): no torch needed to build it.
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    return SAFETENSORS_DTYPES.get(str(dtype).removeprefix("torch."))


class ConversionError(Exception):
    """A conversion or validation failure; the message names the file involved."""


@dataclass
class SourceShard:
    """One input checkpoint file and the output shard it becomes (filled by the preflight pass)."""

    path: Path
    output_name: str
    file_bytes: int
    stored_bytes: int = 0
    names: list[str] = field(default_factory=list)
    mmap_backed: bool = True


@dataclass
class ShardPlan:
    """What goes into one output shard: stored tensors (in file order) and alias -> stored name."""

    tensors: list[tuple[str, torch.Tensor]]
    aliases: dict[str, str]
    mmap_backed: bool
    source: Path

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass
class Outcome:
    changed: bool
    action: str
    shards: int
    nbytes: int
    seconds: float
    files: list[str]
    summary: str

    def as_json(self) -> dict:
        return {
            "changed": self.changed,
            "action": self.action,
            "shards": self.shards,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 3),
            "files": self.files,
        }


class Progress:
    """A one-line byte progress bar on stderr (tqdm is not on the host)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self.last_draw = 0.0
        self.lock = threading.Lock()  # the writer and the verifier thread both report

    def advance(self, nbytes: int, label: str) -> None:
        with self.lock:
            self.done += nbytes
            self.label = label
            now = time.monotonic()
            if self.enabled and (now - self.last_draw >= 0.1 or self.done >= self.total):
                self.last_draw = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * 30)
        rate = self.done / max(now - self.started, 1e-9) / 1e6
        sys.stderr.write(
            f"\r{self.label:<32.32} [{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}% "
            f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate:6.0f} MB/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.last_draw:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------- small OS helpers


def _stop_point(event: str) -> None:
    """Test hook (see STOP_AT_ENV). With --jobs 1 the files on disk at the stop are well defined:
    every earlier shard is published and only this shard's temp file exists."""
    if os.environ.get(STOP_AT_ENV) == event and event not in _STOPPED_AT:
        _STOPPED_AT.add(event)  # once: after SIGCONT the run goes on (a job thread must not stop again)
        print(f"stop-point: {event}", file=sys.stderr, flush=True)
        # To this thread, not the process: a process-directed SIGSTOP may be taken by the main
        # thread, and until it has stopped the group this (job) thread runs on. Under load it
        # finished and published a small shard first (test_sigterm_mid_write_removes_temp found no
        # temp file in 3 of 180 stops, three converters at once on 2 cores). Sent to itself, the
        # thread stops on its way back from the call and stops the others with it.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


_STOPPED_AT: set[str] = set()


class _Aborted(Exception):
    """Another shard's job failed: this one stops at its next chunk (its temp file is removed)."""


def _check_abort(abort: threading.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise _Aborted


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(model_dir: Path) -> list[Path]:
    """Temp files whose writer is gone are leftovers of a killed run: remove them."""
    removed = []
    for path in model_dir.iterdir():
        match = TEMP_RE.match(path.name)
        if match and path.is_file() and not _pid_alive(int(match.group(1))):
            path.unlink()
            removed.append(path)
    if removed:
        atomic_file.fsync_dir(model_dir)
    return removed


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.restype = ctypes.c_int
    _SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now, without waiting.

    Left alone, writeback starts only once dirty pages pass the kernel's background threshold (10%
    of memory): the disk idles while the first gigabytes are copied and verified, and the final
    fsync then waits for almost all of it. Started per chunk, the disk writes while the copy and the
    comparison run, and the fsync finds little left. A hint only: an error or a missing libc call
    changes nothing (the fsync still makes every byte durable)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, SYNC_FILE_RANGE_WRITE)  # offset 0, length 0: the whole file
_MEMCMP = getattr(_LIBC, "memcmp", None)
if _MEMCMP is not None:
    _MEMCMP.restype = ctypes.c_int
    _MEMCMP.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of two contiguous uint8 tensors of one length. libc memcmp runs about 2.5x
    faster than torch.equal here (one pass, no per-element reduction), and verification is what
    bounds the converter's speed; torch.equal is the fallback without a usable libc."""
    if a.numel() != b.numel():
        return False
    if _MEMCMP is None or a.numel() == 0:
        import torch

        return torch.equal(a, b)
    return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel()) == 0


def _release_pages(address: int, length: int) -> None:
    """Drop already-processed pages of a file mapping from our RSS (the page cache keeps them), so
    peak memory stays near one chunk instead of one shard. Only whole pages strictly inside the
    range are dropped; only called for clean pages (mmap-backed source tensors, our unwritten
    private mapping of the output), where a later access simply faults the page back in."""
    if _LIBC is None or not hasattr(_LIBC, "madvise"):
        return
    start = -(-address // PAGE_SIZE) * PAGE_SIZE
    end = (address + length) // PAGE_SIZE * PAGE_SIZE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def _byte_view(flat_u8: torch.Tensor) -> memoryview:
    """Zero-copy memoryview of a contiguous uint8 CPU tensor (works for bf16 sources too, and
    needs no numpy). The caller keeps the tensor alive while the view is used."""
    n = flat_u8.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(flat_u8.data_ptr())).cast("B")


def _as_flat_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Flat uint8 view of the tensor's logical bytes, and whether it aliases the source memory
    (False when a non-contiguous tensor had to be copied)."""
    import torch
    contiguous = tensor.contiguous()
    return contiguous.reshape(-1).view(torch.uint8), contiguous.data_ptr() == tensor.data_ptr()


# ---------------------------------------------------------------- discovering and loading sources


def discover_sources(model_dir: Path) -> list[Path]:
    """Input checkpoint files, in shard order: the .bin index's files if it exists, else globs."""
    bin_index = model_dir / BIN_INDEX_NAME
    if bin_index.exists():
        try:
            weight_map = json.loads(bin_index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConversionError(f"{bin_index}: unreadable index: {exc}") from exc
        paths = [model_dir / name for name in names]
        for path in paths:
            if not path.is_file():
                raise ConversionError(f"{bin_index}: names {path.name}, which does not exist")
        return paths
    # HF layouts: pytorch_model*.bin. Only without those are *.pt files taken as the weights, so
    # stray optimizer.pt / rng_state.pt next to a model are not mistaken for shards.
    for pattern in SOURCE_GLOBS:
        found = sorted(p for p in model_dir.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def output_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _is_zip_checkpoint(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == ZIP_MAGIC


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """Load a checkpoint without running pickled code; returns (state dict, mmap_backed).

    Zip-format checkpoints are memory-mapped, so loading reads only the pickle and tensor bytes are
    paged in as they are copied. Legacy (pre-1.6) files cannot be mapped and are read into memory.
    """
    import torch
    try:
        mmap_backed = _is_zip_checkpoint(path)
        state = torch.load(path, weights_only=True, mmap=mmap_backed, map_location="cpu")
    except Exception as exc:  # torch raises many types for corrupt files; all mean "cannot load"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Weights only load failed" in str(exc):
            raise ConversionError(
                f"{path}: refused: the pickle wants to run code or build non-tensor objects, which "
                f"weights_only loading does not allow ({_unsafe_detail(str(exc))})"
            ) from exc
        raise ConversionError(
            f"{path}: cannot load checkpoint (truncated or corrupt?): {first_line}"
        ) from exc
    return _validate_state_dict(path, state), mmap_backed


def _unsafe_detail(message: str) -> str:
    """The line of torch's weights_only message that says what was refused."""
    for line in message.splitlines():
        if "Unsupported" in line or "GLOBAL" in line:
            return line.strip()
    return "unsupported pickle content"


def _validate_state_dict(path: Path, state: object) -> dict[str, torch.Tensor]:
    import torch
    if not isinstance(state, dict):
        raise ConversionError(f"{path}: checkpoint is a {type(state).__name__}, not a dict of tensors")
    for name, value in state.items():
        if not isinstance(name, str):
            raise ConversionError(f"{path}: key {name!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise ConversionError(
                f"{path}: {name!r} is a {type(value).__name__}, not a tensor (only flat state dicts "
                "of tensors can be converted)"
            )
        if value.layout != torch.strided or value.is_quantized or value.device.type != "cpu":
            raise ConversionError(f"{path}: tensor {name!r} has an unsupported layout ({value.layout})")
        if safetensors_dtype(value.dtype) is None:
            raise ConversionError(f"{path}: tensor {name!r} has dtype {value.dtype}, which safetensors lacks")
    return state


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """Identity of a tensor view: equal keys mean the very same bytes interpreted the same way."""
    if tensor.numel() == 0:
        return None
    storage_ptr = tensor.untyped_storage().data_ptr()
    return (storage_ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def plan_shard(state: dict[str, torch.Tensor], mmap_backed: bool, source: Path) -> ShardPlan:
    """Store each distinct view once; identical views (tied weights) become aliases of the first
    name. Overlapping but different views are stored separately, since safetensors has no views."""
    first_name_by_key: dict[tuple, str] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        key = _view_key(tensor)
        if key is not None and key in first_name_by_key:
            aliases[name] = first_name_by_key[key]
            continue
        if key is not None:
            first_name_by_key[key] = name
        tensors.append((name, tensor))
    # Largest element size first keeps every tensor's offset aligned to its element size.
    tensors.sort(key=lambda item: -item[1].element_size())
    return ShardPlan(tensors, aliases, mmap_backed, source)


def preflight(sources: list[Path]) -> list[SourceShard]:
    """Load every source (pickle only, data stays on disk) before anything is written, so a bad or
    malicious shard anywhere aborts the run with nothing written."""
    shards = []
    owner_of: dict[str, Path] = {}
    for path, output_name in zip(sources, output_names(len(sources)), strict=True):
        state, mmap_backed = load_checkpoint(path)
        plan = plan_shard(state, mmap_backed, path)
        for name in state:
            if name in owner_of:
                raise ConversionError(f"{path}: tensor {name!r} is also in {owner_of[name].name}")
            owner_of[name] = path
        shards.append(SourceShard(path, output_name, path.stat().st_size, plan.stored_bytes, list(state),
                                  mmap_backed))
        del state, plan
    return shards


# ---------------------------------------------------------------- writing and verifying one shard


def _shard_metadata(source: Path, plan: ShardPlan) -> dict[str, str]:
    metadata = {"format": "pt", "gptoss_source": source.name, "gptoss_converter": CONVERTER_ID}
    if plan.aliases:
        metadata["gptoss_aliases"] = json.dumps(plan.aliases, sort_keys=True)
    return metadata


def build_header(plan: ShardPlan, metadata: dict[str, str]) -> bytes:
    """JSON header padded with spaces to a multiple of 8 so the data section starts aligned."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in plan.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": safetensors_dtype(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return encoded + b" " * (-len(encoded) % 8)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, size):
        yield start, min(size, total - start)


def write_shard_file(path: Path, plan: ShardPlan, metadata: dict[str, str], progress: Progress,
                     stop_event: str, abort: threading.Event | None = None) -> None:
    """Write header + raw tensor bytes (no fsync yet: publish_shard does that after verifying).

    Tensors that lie as-is in a mapped source file are copied file to file inside the kernel
    (copy_file_range, as cp does): no page faults on the source mapping and no copy through our
    memory. Everything else (copied non-contiguous tensors, legacy in-memory checkpoints, file
    systems without copy_file_range) is written from memory."""
    header = build_header(plan, metadata)
    spans = source_file_spans(plan)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    source_fd = os.open(plan.source, os.O_RDONLY) if spans else -1
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(header)) + header))
        for name, tensor in plan.tensors:
            label = f"write {path.name.lstrip('.')[:14]} {name}"
            file_offset = spans.get(name)
            if file_offset is not None and _copy_from_file(source_fd, fd, file_offset,
                                                           tensor.numel() * tensor.element_size(),
                                                           progress, label, stop_event, abort):
                continue
            _write_from_memory(fd, tensor, plan.mmap_backed, progress, label, stop_event, abort)
    finally:
        os.close(fd)
        if source_fd >= 0:
            os.close(source_fd)


def _copy_from_file(source_fd: int, fd: int, file_offset: int, nbytes: int, progress: Progress, label: str,
                    stop_event: str, abort: threading.Event | None) -> bool:
    """copy_file_range the tensor's bytes; False (nothing written) when the kernel or file system
    cannot, so the caller writes them from memory instead."""
    done = 0
    while done < nbytes:
        length = min(WRITE_CHUNK, nbytes - done)
        try:
            copied = os.copy_file_range(source_fd, fd, length, file_offset + done)
        except OSError as exc:
            if done == 0 and exc.errno in COPY_RANGE_UNSUPPORTED:
                return False
            raise
        if copied == 0:
            raise ConversionError(f"{label}: source file ended early (changed while converting?)")
        done += copied
        _start_writeback(fd)
        progress.advance(copied, label)
        _stop_point(stop_event)
        _check_abort(abort)
    return True


def _write_from_memory(fd: int, tensor: torch.Tensor, mmap_backed: bool, progress: Progress, label: str,
                       stop_event: str, abort: threading.Event | None) -> None:
    flat, in_place = _as_flat_bytes(tensor)
    view = _byte_view(flat)
    for start, length in _chunks(len(view), WRITE_CHUNK):
        _write_all(fd, view[start : start + length])
        _start_writeback(fd)
        if in_place and mmap_backed:
            _release_pages(flat.data_ptr() + start, length)
        progress.advance(length, label)
        _stop_point(stop_event)
        _check_abort(abort)
    del view, flat


def source_file_spans(plan: ShardPlan) -> dict[str, int]:
    """File offset of each stored tensor whose bytes lie contiguously, unchanged, in the mapped
    source file (found through the mapping in /proc/self/maps that holds the tensor's memory).
    Tensors that are not found are simply written from memory; verification compares the output
    with the tensors' memory either way, so a wrong offset could never go unnoticed."""
    if not plan.mmap_backed or not hasattr(os, "copy_file_range"):
        return {}
    try:
        stat = plan.source.stat()
        maps = _file_mappings(stat.st_dev, stat.st_ino)
    except OSError:
        return {}
    spans: dict[str, int] = {}
    for name, tensor in plan.tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        for start, end, offset in maps:
            if start <= address and address + nbytes <= end:
                if offset + (address - start) + nbytes <= stat.st_size:
                    spans[name] = offset + (address - start)
                break
    return spans


def _file_mappings(dev: int, inode: int) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of this process's mappings of the file with this device and inode."""
    found = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or int(fields[4]) != inode:
                continue
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            if os.makedev(major, minor) != dev:
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            found.append((start, end, int(fields[2], 16)))
    return found


def verify_shard_file(path: Path, plan: ShardPlan, source: Path, progress: Progress,
                      label: str) -> SafetensorsHeader:
    """Re-read the file as written and compare header and every byte with the source tensors.

    Bytes are compared as uint8, so NaN payloads and -0.0 must match exactly too.
    """
    import torch
    try:
        header = read_header(path)
        aliases = aliases_of(header)
    except SafetensorsFormatError as exc:
        raise ConversionError(str(exc)) from exc
    expected = {name: tensor for name, tensor in plan.tensors}
    if set(header.tensors) != set(expected):
        missing, extra = set(expected) - set(header.tensors), set(header.tensors) - set(expected)
        raise ConversionError(f"{path}: tensor names differ from {source.name} "
                              f"(missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]})")
    if aliases != plan.aliases:
        raise ConversionError(f"{path}: recorded aliases {aliases} differ from "
                              f"{source.name}'s {plan.aliases}")
    # Compare against a private read-only mapping of the file: no copy into a buffer, and pages
    # already compared are dropped again so RSS stays at about one chunk.
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        on_disk = torch.frombuffer(mapped, dtype=torch.uint8)
        try:
            for entry in sorted(header.tensors.values(), key=lambda e: e.begin):
                _compare_tensor(path, source, entry, expected[entry.name], on_disk, header.data_start, plan,
                                progress, label)
        finally:
            del on_disk  # the mapping cannot close while a tensor still exports it
    return header


def _compare_tensor(path: Path, source: Path, entry: TensorEntry, tensor: torch.Tensor, on_disk: torch.Tensor,
                    data_start: int, plan: ShardPlan, progress: Progress, label: str) -> None:
    if entry.dtype != safetensors_dtype(tensor.dtype) or entry.shape != list(tensor.shape):
        raise ConversionError(f"{path}: tensor {entry.name!r} is {entry.dtype} {entry.shape}, "
                              f"source has {tensor.dtype} {list(tensor.shape)}")
    flat, in_place = _as_flat_bytes(tensor)
    base = data_start + entry.begin
    for start, length in _chunks(flat.numel(), VERIFY_CHUNK):
        if not bytes_equal(flat[start : start + length], on_disk[base + start : base + start + length]):
            raise ConversionError(f"{path}: tensor {entry.name!r} differs from {source.name} near byte {start}")
        if in_place and plan.mmap_backed:
            _release_pages(flat.data_ptr() + start, length)
        _release_pages(on_disk.data_ptr() + base + start, length)
        progress.advance(length, label)


def _explain_os_error(exc: OSError, final: Path) -> ConversionError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ConversionError(f"{final}: no space left on device while writing; temp file removed, "
                               "originals untouched")
    return ConversionError(f"{final}: {exc.strerror or exc}")


def write_temp_shard(shard: SourceShard, number: int, model_dir: Path, progress: Progress,
                     abort: threading.Event | None = None) -> tuple[Path, ShardPlan]:
    """Write one output shard to its temp file; the temp file is removed if anything fails."""
    final = model_dir / shard.output_name
    temp = _temp_path(final)
    state, mmap_backed = load_checkpoint(shard.path)
    plan = plan_shard(state, mmap_backed, shard.path)
    with _temp_removed_on_error(temp, final):
        write_shard_file(temp, plan, _shard_metadata(shard.path, plan), progress, f"partial:{number}", abort)
    return temp, plan


@contextlib.contextmanager
def _temp_removed_on_error(temp: Path, final: Path) -> Iterator[None]:
    """Any failure removes the temp file, so no half-written output is ever left; OS errors get explained."""
    try:
        yield
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise _explain_os_error(exc, final) from exc
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def publish_shard(temp: Path, shard: SourceShard, plan: ShardPlan, model_dir: Path,
                  progress: Progress, abort: threading.Event | None = None) -> None:
    """Verify the temp file bit for bit, fsync it, rename it into place and fsync the directory.

    Verifying before the fsync reads the same page-cache bytes the fsync then makes durable, and
    lets the disk write back while the comparison runs."""
    final = model_dir / shard.output_name
    with _temp_removed_on_error(temp, final):
        verify_shard_file(temp, plan, shard.path, progress, f"verify {shard.output_name[:20]}")
        _check_abort(abort)  # another job failed or SIGTERM came: publish nothing more
        atomic_file.publish(temp, final)


def remove_own_temp_files(model_dir: Path) -> None:
    for path in model_dir.glob(f".*.tmp-{os.getpid()}"):
        path.unlink(missing_ok=True)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which cgroups and taskset narrow), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs(shards: list[SourceShard]) -> int:
    """Shards converted at once: one per usable CPU, at most one per shard. The in-kernel copy into
    one file is serialised by the file system's inode lock, so parallelism has to be across files,
    and each job needs a CPU for its copy and memcmp. Measured with an 8.6 GB, 8-shard checkpoint:
    2 jobs 7.8 s, 4 jobs 5.5 s, 8 jobs 5.5 s, 16 jobs 5.1 s on the 16-core GPU machine; 2 jobs on the
    2-core box. Legacy checkpoints are read into memory, so they go one at a time to keep peak
    memory at one shard."""
    if not all(shard.mmap_backed for shard in shards):
        return 1
    return max(1, min(usable_cpus(), len(shards)))


def convert_shards(model_dir: Path, shards: list[SourceShard], progress: Progress,
                   jobs: int) -> tuple[list[SourceShard], list[dict[str, str]]]:
    """Convert or re-verify every shard, `jobs` shards at a time; returns (shards written now,
    alias map per shard).

    Each job writes one temp file, verifies it, fsyncs it and renames it into place, so every
    output file is either complete and verified or absent, whatever the order jobs finish in.
    The first failure stops the other jobs at their next chunk; all temp files are removed.
    """
    abort = threading.Event()

    def convert_one(number: int, shard: SourceShard) -> tuple[dict[str, str], bool]:
        _check_abort(abort)
        if (model_dir / shard.output_name).exists():
            aliases = verify_existing_shard(shard, model_dir, progress)
            if aliases is not None:
                return aliases, False
        temp, plan = write_temp_shard(shard, number, model_dir, progress, abort)
        publish_shard(temp, shard, plan, model_dir, progress, abort)
        return plan.aliases, True

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="shard")
    futures: list[Future] = []
    interrupted: BaseException | None = None
    try:
        # Submitting inside the try: a job can reach its first write before this thread reaches wait(),
        # and a SIGTERM then (test_sigterm_mid_write_removes_temp, once in a quick run) left its temp file.
        futures = [pool.submit(convert_one, number, shard) for number, shard in enumerate(shards, start=1)]
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException as exc:  # SIGTERM (SystemExit) or Ctrl-C while the jobs run
        interrupted = exc
    if interrupted is not None or any(future.done() and future.exception() for future in futures):
        abort.set()
        pool.shutdown(wait=True, cancel_futures=True)  # running jobs stop within one chunk
        remove_own_temp_files(model_dir)
        raise (_first_real_error(futures) or interrupted) from None
    pool.shutdown(wait=True)
    outcomes = [future.result() for future in futures]
    written = [shard for shard, (_, was_written) in zip(shards, outcomes, strict=True) if was_written]
    return written, [aliases for aliases, _ in outcomes]


def _first_real_error(futures: list[Future]) -> BaseException | None:
    """The failure that stopped the run, first in shard order; jobs that merely stopped because of
    it (_Aborted) do not count. All futures are done here: the pool has shut down."""
    for future in futures:
        if not future.cancelled() and (error := future.exception()) is not None and not isinstance(error, _Aborted):
            return error
    return None


def verify_existing_shard(shard: SourceShard, model_dir: Path, progress: Progress) -> dict[str, str] | None:
    """Re-verify an output shard left by an earlier run; returns its aliases, or None when it is
    ours but stale (then the caller rewrites it). Files not written by us are never overwritten."""
    final = model_dir / shard.output_name
    try:
        owner = read_header(final).metadata.get("gptoss_source")
    except SafetensorsFormatError as exc:
        # No readable header (truncated or corrupted): nobody's valid output. Keep its bytes aside,
        # never delete them, and convert the shard again from its source.
        damaged = final.with_name(final.name + ".damaged")
        os.replace(final, damaged)
        atomic_file.fsync_dir(model_dir)
        print(f"warning: {final}: unreadable ({exc}); moved to {damaged.name}, converting again", file=sys.stderr)
        return None
    if owner is None:
        raise ConversionError(f"{final}: exists but was not written by {CONVERTER_ID} from "
                              f"{shard.path.name}; refusing to overwrite it")
    if owner != shard.path.name:
        raise ConversionError(f"{final}: was converted from {owner}, expected {shard.path.name}; "
                              "refusing to overwrite it")
    state, mmap_backed = load_checkpoint(shard.path)
    plan = plan_shard(state, mmap_backed, shard.path)
    try:
        verify_shard_file(final, plan, shard.path, progress, f"verify {shard.output_name[:20]}")
    except ConversionError as exc:
        print(f"warning: {exc}; rewriting it", file=sys.stderr)
        final.unlink()
        atomic_file.fsync_dir(model_dir)
        return None
    return plan.aliases


# ---------------------------------------------------------------- the index and the whole run


def build_index(shards: list[SourceShard], aliases_by_shard: list[dict[str, str]]) -> dict:
    weight_map = {name: shard.output_name for shard in shards for name in shard.names}
    for shard, aliases in zip(shards, aliases_by_shard, strict=True):
        for alias in aliases:
            weight_map[alias] = shard.output_name
    return {
        "metadata": {
            "total_size": sum(shard.stored_bytes for shard in shards),
            "format": "pt",
            "converted_by": CONVERTER_ID,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }


def write_text_atomically(path: Path, text: str) -> None:
    """Through our temp name (.NAME.tmp-PID, which a later run recognises and removes), the folder fsynced."""
    atomic_file.write_atomically(path, text, temp=_temp_path(path), sync_dir=True)


def ensure_free_space(model_dir: Path, pending: list[SourceShard]) -> None:
    needed_data = sum(shard.stored_bytes for shard in pending)
    if not pending:
        return
    needed = needed_data + SPACE_MARGIN_BYTES + int(needed_data * SPACE_MARGIN_FRACTION)
    free = shutil.disk_usage(model_dir).free
    if free < needed:
        raise ConversionError(
            f"{model_dir}: not enough free space: converting {len(pending)} shard(s) needs "
            f"{needed / 1e9:.2f} GB (data + margin), {free / 1e9:.2f} GB free; nothing written"
        )


def is_our_index(model_dir: Path) -> bool:
    try:
        index = json.loads((model_dir / INDEX_NAME).read_text(encoding="utf-8"))
        return index.get("metadata", {}).get("converted_by") == CONVERTER_ID
    except (OSError, ValueError, AttributeError):
        return False


def has_foreign_safetensors(model_dir: Path) -> bool:
    """A model that already ships safetensors (not written by us) is left as it is."""
    if (model_dir / INDEX_NAME).exists():
        return not is_our_index(model_dir)
    return (model_dir / "model.safetensors").exists()


def verify_safetensors_model(model_dir: Path, started: float, ignored_sources: list[Path]) -> Outcome:
    problems = check_safetensors_dir(model_dir)
    if problems:
        raise ConversionError("; ".join(problems))
    shard_files = sorted(str(p) for p in model_dir.glob("*.safetensors"))
    nbytes = sum(Path(f).stat().st_size for f in shard_files)
    index = [str(model_dir / INDEX_NAME)] if (model_dir / INDEX_NAME).exists() else []
    note = f" ({len(ignored_sources)} .bin/.pt files left as they are)" if ignored_sources else ""
    summary = f"nothing to convert: {len(shard_files)} safetensors file(s) verified (header and size){note}"
    return Outcome(False, "verified", len(shard_files), nbytes, time.monotonic() - started,
                   shard_files + index, summary)


def plan_check_mode(model_dir: Path, shards: list[SourceShard], delete: bool, started: float) -> Outcome:
    """--check: say what a real run would do; reads headers only, writes nothing."""
    pending = []
    for shard in shards:
        final = model_dir / shard.output_name
        if not final.exists():
            pending.append(shard)
            continue
        try:
            if read_header(final).metadata.get("gptoss_source") != shard.path.name:
                raise ConversionError(f"{final}: exists but was not converted from {shard.path.name}")
        except SafetensorsFormatError:
            pending.append(shard)
    index_missing = not (model_dir / INDEX_NAME).exists()
    changed = bool(pending) or index_missing or delete
    nbytes = sum(shard.stored_bytes for shard in pending)
    action = "would_convert" if pending or index_missing else "verified"
    files = [str(model_dir / shard.output_name) for shard in shards] + [str(model_dir / INDEX_NAME)]
    summary = (f"check: would convert {len(pending)} of {len(shards)} shard(s), {nbytes / 1e9:.2f} GB"
               + ("; would delete originals" if delete else "") + "; nothing written")
    return Outcome(changed, action, len(pending), nbytes, time.monotonic() - started, files, summary)


def delete_originals(model_dir: Path, shards: list[SourceShard]) -> None:
    for shard in shards:
        shard.path.unlink(missing_ok=True)
    (model_dir / BIN_INDEX_NAME).unlink(missing_ok=True)
    atomic_file.fsync_dir(model_dir)


def convert_model(model_dir: Path, *, check: bool, delete: bool, show_progress: bool,
                  jobs: int | None = None) -> Outcome:
    started = time.monotonic()
    sources = discover_sources(model_dir)
    if not sources or has_foreign_safetensors(model_dir):
        return verify_safetensors_model(model_dir, started, sources)
    shards = preflight(sources)
    if check:
        return plan_check_mode(model_dir, shards, delete, started)
    remove_stale_temp_files(model_dir)
    pending = [s for s in shards if not (model_dir / s.output_name).exists()]
    ensure_free_space(model_dir, pending)
    _stop_point("after-space-check")
    total = sum(s.stored_bytes for s in shards) + sum(s.stored_bytes for s in pending)
    progress = Progress(total, show_progress)
    try:
        written, aliases_by_shard = convert_shards(model_dir, shards, progress, jobs or default_jobs(shards))
    finally:
        progress.close()
    index_text = json.dumps(build_index(shards, aliases_by_shard), indent=2) + "\n"
    index_path = model_dir / INDEX_NAME
    index_changed = not index_path.exists() or index_path.read_text(encoding="utf-8") != index_text
    if index_changed:
        write_text_atomically(index_path, index_text)
    problems = check_safetensors_dir(model_dir)
    if problems:
        raise ConversionError("; ".join(problems))
    if delete:
        delete_originals(model_dir, shards)
    return _conversion_outcome(model_dir, shards, written, index_changed, delete, started)


def _conversion_outcome(model_dir: Path, shards: list[SourceShard], written: list[SourceShard],
                        index_changed: bool, deleted: bool, started: float) -> Outcome:
    seconds = time.monotonic() - started
    files = [str(model_dir / s.output_name) for s in shards] + [str(model_dir / INDEX_NAME)]
    written_bytes = sum(s.stored_bytes for s in written)
    all_bytes = sum(s.stored_bytes for s in shards)
    deleted_note = "; originals deleted" if deleted else ""
    if len(written) == len(shards):
        action = "converted"
        rate = written_bytes / 1e6 / max(seconds, 1e-9)
        summary = (f"converted {len(shards)} shard(s), {written_bytes / 1e9:.2f} GB in {seconds:.1f} s "
                   f"({rate:.0f} MB/s), verified bit-for-bit{deleted_note}")
    elif written or index_changed:
        action = "resumed"
        summary = (f"resumed: wrote {len(written)} shard(s) ({written_bytes / 1e9:.2f} GB), skipped "
                   f"{len(shards) - len(written)} already converted, all verified bit-for-bit in "
                   f"{seconds:.1f} s{deleted_note}")
    else:
        action = "verified"
        summary = (f"already converted: {len(shards)} shard(s), {all_bytes / 1e9:.2f} GB verified "
                   f"bit-for-bit against the originals in {seconds:.1f} s{deleted_note}")
    changed = bool(written) or index_changed or deleted
    return Outcome(changed, action, len(shards), all_bytes, seconds, files, summary)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gptoss-convert",
        description="Convert pytorch_model*.bin / *.pt checkpoints in MODEL_DIR to verified safetensors.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=Path)
    parser.add_argument("--delete-originals", action="store_true",
                        help="delete the .bin/.pt files after every output shard is verified")
    parser.add_argument("--check", action="store_true", help="report what would be done; write nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON result object as the last line")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--jobs", type=_positive_int, metavar="N",
                        help="shards converted at once (default: one per usable CPU, at most one per shard; 1 for "
                             "legacy non-zip checkpoints, which are read into memory)")
    return parser.parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    # Turn SIGTERM (systemd, Ansible timeouts) into an exception so temp files get removed.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model_dir.is_dir():
        print(f"gptoss-convert: error: {args.model_dir} is not a directory", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        outcome = convert_model(args.model_dir, check=args.check, delete=args.delete_originals,
                                show_progress=not args.no_progress and sys.stderr.isatty(), jobs=args.jobs)
    except OSError as exc:  # outside a shard write, e.g. an unwritable directory
        return _report_error(f"{exc.filename or args.model_dir}: {exc.strerror or exc}", args.json)
    except ConversionError as exc:
        return _report_error(str(exc), args.json)
    print(outcome.summary, file=sys.stderr)
    if args.json:
        print(json.dumps(outcome.as_json()))
    return 0


def _report_error(message: str, as_json: bool) -> int:
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"changed": False, "failed": True, "msg": message}))
    return 1


if __name__ == "__main__":
    try:
        exit_code = main()
    except SystemExit as exc:  # usage errors, --help, SIGTERM (temp files are already removed)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        exit_code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch loaded it takes ~0.5-0.8 s, and by now every file is
    # fsynced and every temp file removed, so nothing is left for atexit handlers to do.
    os._exit(exit_code)
