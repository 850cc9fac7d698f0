"""Fetch a set of files into a folder: resumable, sha256-verified, switched in atomically.

Shared by the `gptoss.host.model_fetch` module (model weights and tiktoken encodings) and its unit
tests. Standard library only: it runs on the host with the system python, before any venv exists.

The flow for one target folder:
  1. plan: the manifest (path, size, sha256 per file) against what the live folder already holds;
  2. free space: the bytes still to download must fit the target's file system, checked before
     the first byte is fetched;
  3. download into a staging folder next to the target (same file system, so the switch is a
     rename): each file goes to `<name>.partial` and resumes from its length with an HTTP Range
     request (or a seek for file:// URLs), then is hashed and renamed to its name only when its
     sha256 matches; a mismatch deletes the partial and fails;
  4. switch: the staging folder replaces the target in one renameat2(RENAME_EXCHANGE), so readers
     see the old folder or the new one, never a mix; the old one is then removed.
A marker file in the target records the manifest it was built from, so a second run with the same
manifest changes nothing.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ansible_collections.gptoss.host.plugins.module_utils import atomic_file

MARKER = ".gptoss-fetch.json"
CHUNK = 1 << 20
# Room kept free on the target's file system beyond the files themselves (journal, logs, the
# marker): a model disk filled to the last block breaks the next write of anything.
FREE_SPACE_MARGIN = 64 << 20
RENAME_EXCHANGE = 2


class FetchError(Exception):
    """A refusal with a sentence for the user; nothing live was changed."""


@dataclass(frozen=True)
class FileSpec:
    path: str  # relative, POSIX
    size: int
    sha256: str  # "" only for a hub's small non-LFS files, which carry git_sha1 instead
    git_sha1: str = ""  # the git blob id the Hugging Face hub gives for non-LFS files


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


# ---------------------------------------------------------------- manifest


def parse_manifest(data: dict) -> tuple[str, list[FileSpec]]:
    """(revision, files) from `{"revision": str, "files": [{"path", "size", "sha256"}]}`."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), list) or not data["files"]:
        raise FetchError("manifest: expected {'revision': ..., 'files': [{'path', 'size', 'sha256'}, ...]}")
    revision = str(data.get("revision") or "")
    if not revision:
        raise FetchError("manifest: no revision (pin one: the files must not change under the same name)")
    files, seen = [], set()
    for number, entry in enumerate(data["files"], start=1):
        try:
            path, size, digest = str(entry["path"]), int(entry["size"]), str(entry["sha256"]).lower()
        except (KeyError, TypeError, ValueError) as err:
            raise FetchError(f"manifest file {number}: needs path, size and sha256 ({err})") from err
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts or path.startswith("."):
            raise FetchError(f"manifest file {number}: {path!r} must be a relative path inside the folder")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise FetchError(f"manifest file {number}: {path}: sha256 must be 64 hex digits")
        if size < 0 or path in seen:
            raise FetchError(f"manifest file {number}: {path}: negative size or listed twice")
        seen.add(path)
        files.append(FileSpec(path, size, digest))
    return revision, files


def manifest_id(revision: str, files: list[FileSpec]) -> str:
    """One digest for a manifest's content: the marker compares it, not the manifest's URL."""
    text = json.dumps([revision, [[f.path, f.size, f.sha256] for f in files]])
    return hashlib.sha256(text.encode()).hexdigest()


def read_url(url: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http/https/file by design)
        return response.read()


def file_url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + "/" + urllib.parse.quote(path)


# ---------------------------------------------------------------- state on disk


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def read_marker(target: Path) -> dict:
    try:
        return json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def is_current(target: Path, ident: str, files: list[FileSpec]) -> bool:
    """The live folder was switched in from this manifest and every file still has its size."""
    if read_marker(target).get("manifest_id") != ident:
        return False
    return all((target / f.path).is_file() and (target / f.path).stat().st_size == f.size for f in files)


def staging_dir_for(target: Path, ident: str) -> Path:
    """Next to the target (same file system: the switch is a rename); named by the manifest so a
    killed run resumes into the same folder and another manifest never mixes with it."""
    return target.parent / f".{target.name}.staging-{ident[:16]}"


def bytes_to_fetch(staging: Path, files: list[FileSpec]) -> int:
    """What is still missing: finished files count 0, partial ones their remainder."""
    missing = 0
    for spec in files:
        done = staging / spec.path
        if done.is_file() and done.stat().st_size == spec.size:
            continue
        partial = partial_path(staging / spec.path)
        have = partial.stat().st_size if partial.is_file() else 0
        missing += spec.size - min(have, spec.size)
    return missing


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def kept_partial(dest: Path, spec: FileSpec) -> tuple[Path, int]:
    """`dest`'s partial file and the bytes a killed run left in it to resume from; one longer than the
    file is not this file's start and is dropped."""
    partial = partial_path(dest)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > spec.size:
        partial.unlink()
        have = 0
    return partial, have


def check_free_space(folder: Path, needed: int, margin: int = FREE_SPACE_MARGIN) -> None:
    free = shutil.disk_usage(folder).free
    if needed + margin > free:
        raise FetchError(
            f"{folder}: {needed} bytes still to download (+{margin} kept free) but only {free} bytes free;"
            " nothing was downloaded"
        )


# ---------------------------------------------------------------- download


def open_from(url: str, offset: int, timeout: float):
    """(stream, resumed): a stream of the file from `offset` if the source allows it, else from 0."""
    if url.startswith("file://"):
        handle = open(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "rb")  # noqa: SIM115
        handle.seek(offset)
        return handle, True
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # our partial is longer than the file: start over
            return open_from(url, 0, timeout)
        raise FetchError(f"{url}: HTTP {err.code} {err.reason}") from err
    except (urllib.error.URLError, OSError) as err:
        raise FetchError(f"{url}: {getattr(err, 'reason', err)}") from err
    # 206: the server honoured the Range; 200: it sends the whole file, so the partial is restarted.
    return response, response.status == 206


def download_file(url: str, dest: Path, spec: FileSpec, progress: Progress | None = None,
                  done_before: int = 0, total: int = 0, timeout: float = 60.0,
                  deadline: float | None = None) -> bool:
    """Fetch one file to `dest` (via dest.partial, resumed) and verify it; False when the deadline hit first."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial, have = kept_partial(dest, spec)
    if have < spec.size or spec.size == 0:
        stream, resumed = open_from(url, have, timeout)
        with stream, partial.open("ab" if resumed else "wb") as out:
            have = have if resumed else 0
            while have < spec.size:
                block = stream.read(min(CHUNK, spec.size - have))
                if not block:
                    break
                out.write(block)
                have += len(block)
                if progress:
                    progress(done_before + have, total)
                if deadline is not None and time.monotonic() > deadline and have < spec.size:
                    return False
            out.flush()
            os.fsync(out.fileno())
    if have != spec.size:
        raise FetchError(f"{spec.path}: the source ended at {have} of {spec.size} bytes; the partial file is kept")
    finish_partial(partial, dest, spec)
    return True


def finish_partial(partial: Path, dest: Path, spec: FileSpec) -> None:
    """A whole partial file becomes `dest` only if it is the one described; a wrong one is deleted."""
    problem = verify_file(partial, spec)
    if problem:
        partial.unlink()
        raise FetchError(f"{problem}; refused, the live folder is unchanged")
    os.replace(partial, dest)


def fetch_to_staging(base_url: str, staging: Path, files: list[FileSpec], progress: Progress | None = None,
                     deadline: float | None = None) -> bool:
    """Every file into `staging`, verified; False when the deadline came first (call again to go on)."""
    staging.mkdir(parents=True, exist_ok=True)
    total = sum(f.size for f in files)
    done = 0
    for spec in files:
        dest = staging / spec.path
        if dest.is_file() and dest.stat().st_size == spec.size:
            done += spec.size
            continue
        if not download_file(file_url(base_url, spec.path), dest, spec, progress, done, total, deadline=deadline):
            return False
        done += spec.size
    return True


def git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 (git's object id)
    with path.open("rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: Path, spec: FileSpec) -> str:
    """'' when the file is the one described, else the problem."""
    if not path.is_file():
        return f"{spec.path}: missing"
    if path.stat().st_size != spec.size:
        return f"{spec.path}: {path.stat().st_size} bytes, expected {spec.size}"
    if spec.sha256:
        actual = sha256_of(path)
        return "" if actual == spec.sha256 else f"{spec.path}: sha256 {actual} does not match {spec.sha256}"
    actual = git_blob_sha1(path)
    return "" if actual == spec.git_sha1 else f"{spec.path}: git blob id {actual} does not match {spec.git_sha1}"


def verify_folder(folder: Path, files: list[FileSpec]) -> None:
    """Every file of the list (the staged copy, before it goes live); the first problem refuses it."""
    for spec in files:
        problem = verify_file(folder / spec.path, spec)
        if problem:
            raise FetchError(f"{problem}; refused, the live folder is unchanged")


# ---------------------------------------------------------------- hubs (official clients only)
# The hf path runs in the tests against olah, a real hub mirror serving a git repository
# (tests/test_hub_mirror_lab.py); ModelScope cannot be reached from the lab or CI.


def require_commit(revision: str) -> None:
    if len(revision) != 40 or any(c not in "0123456789abcdef" for c in revision.lower()):
        raise FetchError(f"revision {revision!r}: pin a full 40-hex commit id (a branch name can move)")


def hub_error(endpoint: str | None, what: str, err: Exception) -> FetchError:
    """The client's error as a refusal that names the endpoint and carries the server's own answer."""
    where = endpoint or "the hub (the client's default endpoint)"
    status = getattr(getattr(err, "response", None), "status_code", None)
    hint = ""
    if status in (401, 403):
        hint = " (check model_weights_token: the endpoint refused it, or needs one)"
    text = " ".join(str(err).split())[:600]
    # The client's last word is often generic ("check your connection"): the first error says why.
    root = err
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    cause = f" (cause: {type(root).__name__}: {' '.join(str(root).split())[:300]})" if root is not err else ""
    return FetchError(f"{where}: {what}: {type(err).__name__}: {text}{cause}{hint}; the live folder is unchanged")


def hf_file_list(repo_id: str, revision: str, endpoint: str | None, token: str | None) -> list[FileSpec]:
    """Files at a pinned commit with the hub's own sums: LFS sha256, or the git blob id otherwise.

    One call, GET api/models/<repo>/tree/<commit>?recursive=true: every file's size, blob id and LFS
    sha256. model_info(files_metadata=True) would give the same on the hub itself, but a mirror (olah)
    answers it with file names only. Top-level dotfiles (.gitattributes) are the repository's git
    bookkeeping, not the model, and are left out (the mirror manifest refuses such paths too)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = list(HfApi(endpoint=endpoint or None, token=token or None).list_repo_tree(
            repo_id, revision=revision, recursive=True))
    except Exception as err:  # noqa: BLE001 (every client error becomes a refusal that names the endpoint)
        raise hub_error(endpoint, f"listing {repo_id} at {revision}", err) from err
    files = []
    for entry in entries:
        if not isinstance(entry, RepoFile) or entry.path.startswith("."):
            continue
        if entry.lfs is not None:
            files.append(FileSpec(entry.path, int(entry.lfs.size), str(entry.lfs.sha256).lower()))
        else:
            files.append(FileSpec(entry.path, int(entry.size), "", str(entry.blob_id)))
    if not files:
        raise FetchError(f"{endpoint or 'the hub'}: {repo_id} at {revision} lists no files;"
                         " the live folder is unchanged")
    return files


def hf_download(repo_id: str, revision: str, spec: FileSpec, staging: Path, endpoint: str | None,
                token: str | None) -> None:
    """HEAD then GET resolve/<commit>/<path> with the official client's own calls, into
    `<name>.partial`, resumed with a Range request from its length on the next run.

    hf_hub_download itself cannot resume a killed run: since huggingface_hub 1.x it writes each
    attempt to a new `<etag>.<random>.incomplete` opened empty (its PR 4228), so a killed download
    leaves that file behind and the next run starts from byte 0. http_get (the client's GET, with
    its retries, redirects and token handling) takes the bytes already there instead; a server that
    ignores Range answers 200 and http_get starts the file over. Files the hub keeps in Xet storage
    (HEAD answers X-Xet-Hash) go through hf_hub_download, whose Xet path has no byte ranges to resume."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    what = f"downloading {spec.path} of {repo_id} at {revision}"
    try:
        url = hf_hub_url(repo_id, spec.path, revision=revision, endpoint=endpoint or None)
        meta = get_hf_file_metadata(url, token=token or None, endpoint=endpoint or None)
        if meta.xet_file_data is not None:
            hf_hub_download(repo_id, spec.path, revision=revision, local_dir=str(staging),
                            endpoint=endpoint or None, token=token or None)
            return
        dest = staging / spec.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial, have = kept_partial(dest, spec)
        partial.touch()
        with partial.open("r+b") as out:
            out.seek(have)
            http_get(url, out, resume_size=have, headers=build_hf_headers(token=token or None),
                     expected_size=spec.size, displayed_filename=spec.path)
            out.flush()
            os.fsync(out.fileno())
    except Exception as err:  # noqa: BLE001 (as above)
        raise hub_error(endpoint, what, err) from err
    finish_partial(partial, dest, spec)


def modelscope_file_list(model_id: str, revision: str, token: str | None) -> list[FileSpec]:
    from modelscope.hub.api import HubApi

    api = HubApi()
    if token:
        api.login(token)
    entries = api.get_model_files(model_id, revision=revision, recursive=True)
    return [FileSpec(str(e["Path"]), int(e["Size"]), str(e["Sha256"]).lower())
            for e in entries if e.get("Type") != "tree"]


def modelscope_download(model_id: str, revision: str, spec: FileSpec, staging: Path) -> None:
    from modelscope.hub.file_download import model_file_download

    model_file_download(model_id, spec.path, revision=revision, local_dir=str(staging))


def clean_client_state(staging: Path) -> None:
    """The clients' own bookkeeping (.cache/...) must not go live with the model."""
    shutil.rmtree(staging / ".cache", ignore_errors=True)


# ---------------------------------------------------------------- switch


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE, Linux 3.15+, glibc 2.28+)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(code)}")


def switch_in(staging: Path, target: Path, ident: str, revision: str) -> None:
    """Make `staging` the live `target` in one rename; the previous folder is removed afterwards."""
    (staging / MARKER).write_text(json.dumps({"manifest_id": ident, "revision": revision}) + "\n")
    for path in [staging, *staging.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    atomic_file.fsync_dir(staging)
    if not target.exists():
        os.rename(staging, target)
    else:
        try:
            exchange(staging, target)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            # A file system without RENAME_EXCHANGE: two renames, the target missing in between.
            old = target.with_name(f".{target.name}.old")
            os.rename(target, old)
            os.rename(staging, target)
            staging = old
        shutil.rmtree(staging)  # now the previous folder
    atomic_file.fsync_dir(target.parent)




def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"
