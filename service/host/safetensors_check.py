"""Structural checks for .safetensors files and model directories.

Standard library only: this runs under the host's plain system python3 (``invoke verify``) as well as
inside the converter. It never loads tensor data; it checks that each header is well formed and that
the byte ranges it declares tile the data section exactly, so a truncated or padded file is caught.

Usage: ``python3 -m service.host.safetensors_check DIR_OR_FILE`` prints one problem per line, exit 1 if any.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
# Same limit as the reference implementation: a larger header is almost surely garbage.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bits per element, so the packed 4/6-bit formats are handled like the byte-sized ones.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class SafetensorsFormatError(ValueError):
    """The file is not a structurally valid safetensors file; the message names the file."""


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    begin: int
    end: int


@dataclass
class SafetensorsHeader:
    path: Path
    header_len: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


def expected_nbytes(dtype: str, shape: list[int]) -> int | None:
    """Bytes a tensor of this dtype/shape occupies, or None when the bit count is not whole bytes."""
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    return bits // 8 if bits % 8 == 0 else None


def _parse_entry(path: Path, name: str, raw: object) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(raw, dict):
        raise SafetensorsFormatError(f"{where}: entry is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise SafetensorsFormatError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsFormatError(f"{where}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SafetensorsFormatError(f"{where}: bad data_offsets {offsets!r}")
    nbytes = expected_nbytes(dtype, shape)
    if nbytes is None:
        raise SafetensorsFormatError(f"{where}: {dtype} x {shape} is not a whole number of bytes")
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsFormatError(
            f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, {dtype} x {shape} needs {nbytes}"
        )
    return TensorEntry(name, dtype, list(shape), offsets[0], offsets[1])


def _parse_metadata(path: Path, raw: object) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise SafetensorsFormatError(f"{path}: __metadata__ must map strings to strings")
    return dict(raw)


def read_header(path: Path | str) -> SafetensorsHeader:
    """Parse and validate the header of one file (offsets, sizes); raises SafetensorsFormatError."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsFormatError(f"{path}: {file_size} bytes, too short for a header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise SafetensorsFormatError(
                    f"{path}: header length {header_len} does not fit in a {file_size}-byte file"
                )
            raw_header = f.read(header_len)
    except OSError as exc:
        raise SafetensorsFormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        parsed = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"{path}: header is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise SafetensorsFormatError(f"{path}: header is not a JSON object")
    metadata = _parse_metadata(path, parsed.pop("__metadata__")) if "__metadata__" in parsed else {}
    tensors = {name: _parse_entry(path, name, raw) for name, raw in parsed.items()}
    header = SafetensorsHeader(path, header_len, tensors, metadata)
    _check_offsets_tile_data(header)
    expected_size = header.data_start + header.data_len
    if file_size != expected_size:
        raise SafetensorsFormatError(
            f"{path}: file is {file_size} bytes, header describes {expected_size} "
            f"({'truncated' if file_size < expected_size else 'trailing bytes'})"
        )
    return header


def _check_offsets_tile_data(header: SafetensorsHeader) -> None:
    """Tensors must cover the data section back to back: no gaps, no overlaps."""
    position = 0
    for entry in sorted(header.tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            kind = "gap before" if entry.begin > position else "overlap at"
            raise SafetensorsFormatError(
                f"{header.path}: tensor {entry.name!r}: {kind} data offset {entry.begin} "
                f"(expected {position})"
            )
        position = entry.end


def check_safetensors_file(path: Path | str) -> list[str]:
    """Problems with one file (empty list when it is structurally sound)."""
    try:
        read_header(path)
    except SafetensorsFormatError as exc:
        return [str(exc)]
    return []


def aliases_of(header: SafetensorsHeader) -> dict[str, str]:
    """Alias name -> stored name, as recorded by gptoss-convert for tied tensors (else empty)."""
    raw = header.metadata.get("gptoss_aliases")
    if not raw:
        return {}
    try:
        aliases = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SafetensorsFormatError(f"{header.path}: gptoss_aliases metadata is not JSON: {exc}") from exc
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise SafetensorsFormatError(f"{header.path}: gptoss_aliases must map names to names")
    return aliases


def _check_file_names(header: SafetensorsHeader, names: list[str]) -> list[str]:
    """Every name the index maps to this file must be stored in it or be a recorded alias."""
    problems = []
    aliases = aliases_of(header)
    for alias, target in aliases.items():
        if target not in header.tensors:
            problems.append(f"{header.path}: alias {alias!r} points at {target!r}, which is not stored there")
    for name in names:
        if name not in header.tensors and name not in aliases:
            problems.append(f"{header.path}: index maps tensor {name!r} here but the file does not hold it")
    return problems


def load_index(index_path: Path) -> dict:
    """Parse an index file; raises SafetensorsFormatError naming it."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"{index_path}: unreadable index: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SafetensorsFormatError(f"{index_path}: weight_map must map tensor names to file names")
    return index


def _check_indexed_dir(directory: Path, index_path: Path) -> list[str]:
    try:
        index = load_index(index_path)
    except SafetensorsFormatError as exc:
        return [str(exc)]
    names_by_file: dict[str, list[str]] = {}
    for name, file_name in index["weight_map"].items():
        names_by_file.setdefault(file_name, []).append(name)
    problems: list[str] = []
    stored_bytes = 0
    for file_name, names in sorted(names_by_file.items()):
        path = directory / file_name
        if Path(file_name).name != file_name:
            problems.append(f"{index_path}: weight_map names {file_name!r}, which is not a plain file name")
            continue
        if not path.is_file():
            problems.append(f"{index_path}: weight_map names {file_name}, which does not exist")
            continue
        try:
            header = read_header(path)
            problems += _check_file_names(header, names)
        except SafetensorsFormatError as exc:
            problems.append(str(exc))
            continue
        stored_bytes += header.data_len
    problems += _check_total_size(index_path, index, stored_bytes, not problems)
    return problems


def _check_total_size(index_path: Path, index: dict, stored_bytes: int, all_files_ok: bool) -> list[str]:
    """total_size must be a size; it is only compared exactly for indexes this project wrote, because
    upstream tools disagree on what it counts."""
    metadata = index.get("metadata") or {}
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is None:
        return []
    if not isinstance(total, int) or total < 0:
        return [f"{index_path}: metadata.total_size {total!r} is not a byte count"]
    if all_files_ok and metadata.get("converted_by") == "gptoss-convert" and total != stored_bytes:
        return [f"{index_path}: metadata.total_size {total} but the shards hold {stored_bytes} bytes"]
    return []


def check_safetensors_dir(path: Path | str) -> list[str]:
    """Problems with a model directory's safetensors weights (empty list when sound).

    With an index, every file it names must exist and be sound; without one, every top-level
    *.safetensors file is checked and there must be at least one.
    """
    directory = Path(path)
    if not directory.is_dir():
        return [f"{directory}: not a directory"]
    index_path = directory / INDEX_NAME
    if index_path.exists():
        return _check_indexed_dir(directory, index_path)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return [f"{directory}: no .safetensors files and no {INDEX_NAME}"]
    problems: list[str] = []
    for file in files:
        problems += check_safetensors_file(file)
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m service.host.safetensors_check DIR_OR_FILE", file=sys.stderr)
        return 2
    target = Path(args[0])
    problems = check_safetensors_file(target) if target.is_file() else check_safetensors_dir(target)
    for problem in problems:
        print(problem)
    if not problems:
        print(f"ok: {target}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
