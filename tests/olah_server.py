"""A real Hugging Face hub mirror for the tests: olah (its own venv), offline, serving a git repository.

olah (a self-hosted hub mirror, pure Python) serves git repositories found under its `mirrors-path`
(`<mirrors>/models/<org>/<repo>`) through the hub's API, with nothing upstream in offline mode. The
repository is built here the way the hub stores one: large files as git-LFS pointer blobs, their bytes
under `.git/lfs/objects/<aa>/<bb>/<sha256>` (where olah reads them), small files as plain blobs.

What olah 0.5.x does in this mode, read in its source (olah/mirror/repos.py, server_file_routes.py,
server_access.py) and relied on by the tests:
  - revisions: any ref or commit git can resolve; `api/models/<repo>/revision/<rev>` gives the commit;
  - `tree/<rev>` lists each file with size, git blob id and, for LFS, the sha256 (`lfs.oid`);
  - `resolve/<rev>/<path>`: HEAD answers X-Repo-Commit and ETag (the LFS sha256, or the blob id);
    GET sends the whole file and ignores Range (a resume restarts the file);
  - tokens: never checked while offline (visibility is only ever asked of the upstream).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("GPTOSS_CACHE_DIR", ROOT / ".cache"))
# Files of at least this size go to LFS, as the hub's .gitattributes does for weights.
LFS_MIN_SIZE = 100 * 1024
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
GIT_ENV = {"GIT_AUTHOR_NAME": "gptoss-test", "GIT_AUTHOR_EMAIL": "test@gptoss.invalid",
           "GIT_COMMITTER_NAME": "gptoss-test", "GIT_COMMITTER_EMAIL": "test@gptoss.invalid"}


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}, check=True)
    return proc.stdout.strip()


class HubRepo:
    """A git repository laid out as a hub model repository (branch main), committed file by file."""

    def __init__(self, mirrors: Path, repo_id: str):
        self.repo_id = repo_id
        self.path = mirrors / "models" / repo_id
        self.path.mkdir(parents=True)
        self.lfs: dict[str, str] = {}  # path -> sha256 of its bytes, as last committed
        git(self.path, "init", "-q", "-b", "main")
        (self.path / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
                                                  "*.bin filter=lfs diff=lfs merge=lfs -text\n")

    def commit(self, files: dict[str, bytes], message: str) -> str:
        """Write `files` (LFS pointers for the large ones), commit on main; the new commit id."""
        for name, data in files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if len(data) >= LFS_MIN_SIZE:
                oid = self.lfs[name] = hashlib.sha256(data).hexdigest()
                obj = self.path / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
                obj.parent.mkdir(parents=True, exist_ok=True)
                obj.write_bytes(data)
                target.write_text(LFS_POINTER.format(oid=oid, size=len(data)))
            else:
                target.write_bytes(data)
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", message)
        return git(self.path, "rev-parse", "HEAD")

    def lfs_sha256(self, name: str) -> str:
        return self.lfs[name]


def install_olah() -> Path:
    """olah's venv (`invoke lab.olah`: installed once, cached under .cache/olah-venv)."""
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "invoke"), "lab.olah"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"invoke lab.olah failed:\n{proc.stdout}\n{proc.stderr}")
    return CACHE_DIR / "olah-venv"


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


class Olah:
    """olah serving `mirrors` on address:port, offline; its access log in `log`."""

    def __init__(self, venv: Path, mirrors: Path, workdir: Path, address: str = "127.0.0.1", port: int = 0):
        self.venv, self.mirrors, self.workdir, self.address = venv, mirrors, workdir, address
        self.port = port or free_port(address)
        self.log = workdir / "olah.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def config(self) -> Path:
        path = self.workdir / "olah.toml"
        path.write_text(
            "[basic]\n"
            f'host = "{self.address}"\nport = {self.port}\n'
            f'repos-path = "{self.workdir / "repos"}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n'
            "[accessibility]\noffline = true\n")
        return path

    def start(self, timeout: float = 60) -> Olah:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.config()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([str(self.venv / "bin" / "olah-cli"), "-c", str(config)],
                                         cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/api/models/none/none", timeout=2)  # noqa: S310
            except urllib.error.HTTPError:
                return self  # any HTTP answer: it is serving
            except OSError:
                time.sleep(0.3)
                continue
            return self
        self.stop()
        raise RuntimeError(f"olah did not answer on {self.url} within {timeout}s:\n{self.log.read_text()[-3000:]}")

    def stop(self, crash: bool = False) -> None:
        """SIGTERM lets uvicorn finish the responses under way; `crash` (SIGKILL) cuts them off, as a
        mirror that dies or a network that drops would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL if crash else signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def requests(self) -> list[str]:
        """The access log's requests as "METHOD /path STATUS" (uvicorn logs each when its answer
        starts), in order."""
        lines = []
        for line in self.log.read_text(errors="replace").splitlines():
            parts = line.split('"')
            if len(parts) >= 3 and " HTTP/1." in parts[1]:
                status = parts[2].split()[0] if parts[2].split() else "?"
                lines.append(f"{parts[1].rsplit(' HTTP/', 1)[0]} {status}")
        return lines

    def __enter__(self) -> Olah:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def copy_model(source: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(source.iterdir()) if p.is_file()}


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
