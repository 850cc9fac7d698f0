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
  - tokens: never checked while offline (visibility is only ever asked of the upstream). Online, as a
    proxy, olah asks its upstream whether the repository is visible with the caller's Authorization
    header (server_access.py ensure_repo_visibility, cached per caller token) and answers a refusal
    with 401 "Repository not found": a mirror in front of a hub that wants a token (TokenGate).
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import shutil
import signal
import socket
import subprocess
import threading
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

    def settings(self) -> str:
        """The [basic] lines beyond address and caches, and the [accessibility] table."""
        return f'mirrors-path = ["{self.mirrors}"]\n[accessibility]\noffline = true\n'

    def config(self) -> Path:
        path = self.workdir / "olah.toml"
        path.write_text(
            "[basic]\n"
            f'host = "{self.address}"\nport = {self.port}\n'
            f'repos-path = "{self.workdir / "repos"}"\n' + self.settings())
        return path

    def serve_repo_info(self, repo_id: str, commit: str) -> None:
        """Let this offline mirror answer `api/models/<repo>` (the repository's info without a
        revision), which an olah proxy in front asks before every API call (its visibility check).
        Offline, olah answers it only from `<repos-path>/api/models/<repo>/revision/*/meta_head.json`
        (what an olah that once ran online keeps; olah/utils/repo_utils.py
        get_newest_commit_hf_offline), never from its git mirror: without it the proxy answers 401
        Repository not found. Stored here is olah's own answer to `api/models/<repo>/revision/<commit>`."""
        with urllib.request.urlopen(f"{self.url}/api/models/{repo_id}/revision/{commit}", timeout=60) as answer:  # noqa: S310
            meta = answer.read()
        path = self.workdir / "repos" / "api" / "models" / repo_id / "revision" / commit / "meta_head.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(meta)

    def start(self, timeout: float = 60) -> Olah:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.config()
        with self.log.open("ab") as log:
            # olah's own entry point, run by the venv's interpreter rather than through its `olah-cli`
            # script: a script's first line names the interpreter by the path the venv was built
            # through, so a .cache reached by another path (a moved clone) would keep a script that
            # cannot start.
            entry = "import sys; from olah.server import cli; sys.argv[0] = 'olah-cli'; sys.exit(cli())"
            self.proc = subprocess.Popen([str(self.venv / "bin" / "python"), "-c", entry, "-c", str(config)],
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


class OlahProxy(Olah):
    """olah online, as a caching proxy in front of `upstream` (another olah: a hub to it), with its
    block cache. Unlike the git mirror it answers a Range request with 206 and only those bytes
    (olah/proxy/files.py). Its blocks are fetched from the upstream with Range; the git mirror
    upstream answers those with 200 and the whole file, so a block must hold the whole file
    (`block_size` at least the largest file; olah needs a multiple of its 1 MiB chunks): with
    smaller blocks a block past the first gets the file's first bytes and the answer breaks off."""

    def __init__(self, venv: Path, upstream: Olah | TokenGate, workdir: Path, block_size: int,
                 address: str = "127.0.0.1", port: int = 0):
        super().__init__(venv, upstream.mirrors, workdir, address, port)
        self.upstream, self.block_size = upstream, block_size

    def settings(self) -> str:
        netloc = f"{self.upstream.address}:{self.upstream.port}"
        return (f"cache-block-size = {self.block_size}\n"
                f'hf-scheme = "http"\nhf-netloc = "{netloc}"\nhf-lfs-netloc = "{netloc}"\n'
                "[accessibility]\noffline = false\n")

    def upstream_requests(self) -> list[str]:
        """What it asked its upstream, as "METHOD /path STATUS" (its httpx log lines), in order."""
        lines = []
        for line in self.log.read_text(errors="replace").splitlines():
            if "HTTP Request: " in line and '"HTTP/' in line:
                method, url = line.split("HTTP Request: ", 1)[1].split('"')[0].split()[:2]
                path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else url
                lines.append(f"{method} {path} {line.rsplit('HTTP/', 1)[1].split()[1]}")
        return lines


class TokenGate:
    """The hub as a private repository's owner sees it: every request must carry `Authorization: Bearer
    <token>`, or it is answered 401 as the hub answers a bad token; with it, the request goes on to
    `upstream` (an offline olah) and its answer comes back as it is, streamed. An OlahProxy with this
    gate as its upstream is then a mirror that demands the token (olah cannot be set to check one
    itself): it forwards each caller's header and relays the refusal. `log`: "METHOD /path STATUS"."""

    HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                  "proxy-authenticate", "proxy-authorization"}

    def __init__(self, upstream: Olah, token: str, address: str = "127.0.0.1"):
        self.upstream, self.token, self.address = upstream, token, address
        self.mirrors = upstream.mirrors  # what an OlahProxy in front serves from (see OlahProxy)
        self.log: list[str] = []
        self.server: http.server.ThreadingHTTPServer | None = None
        self.port = 0

    def start(self) -> TokenGate:
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a body ends with the connection: no re-chunking here

            def __getattr__(self, name: str):
                # http.server calls do_<METHOD> as the request line spells it, and answers 501 where
                # there is none: olah's file proxy spells its methods in lower case, and posts paths-info.
                if name.startswith("do_"):
                    return lambda: gate.forward(self)
                raise AttributeError(name)

            def log_message(self, *args) -> None:  # the gate's own log instead of stderr
                pass

        self.server = http.server.ThreadingHTTPServer((self.address, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def forward(self, request: http.server.BaseHTTPRequestHandler) -> None:
        method = request.command.upper()
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            body = b'{"error":"Invalid credentials in Authorization header"}'
            self.log.append(f"{method} {request.path} 401")
            request.send_response(401)
            request.send_header("Content-Type", "application/json")
            request.send_header("X-Error-Message", "Invalid credentials in Authorization header")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            if method != "HEAD":
                request.wfile.write(body)
            return
        connection = http.client.HTTPConnection(self.upstream.address, self.upstream.port, timeout=120)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP_BY_HOP | {"host"}}
        # olah asks paths-info with a form POST: its body goes on too.
        length = int(request.headers.get("Content-Length") or 0)
        connection.request(method, request.path, body=request.rfile.read(length) if length else None, headers=headers)
        answer = connection.getresponse()
        self.log.append(f"{method} {request.path} {answer.status}")
        request.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in self.HOP_BY_HOP:
                request.send_header(key, value)
        request.end_headers()
        while method != "HEAD" and (block := answer.read(1 << 20)):
            request.wfile.write(block)
        connection.close()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def copy_model(source: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(source.iterdir()) if p.is_file()}


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
