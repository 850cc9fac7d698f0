"""A static HTTP file server with byte ranges, for the mirror tests (the controller and the lab).

Python's http.server ignores Range headers; a mirror that resumes downloads must honour them, as
nginx does. This server does (one `bytes=N-` or `bytes=N-M` range), logs every request's path and
Range so a test can see that a resume asked for the rest only, and can be slowed down so that a
test can kill a download in the middle of a file.
"""

from __future__ import annotations

import re
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class MirrorServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, address: str = "127.0.0.1", port: int = 0, bytes_per_s: int = 0):
        self.root = root
        self.bytes_per_s = bytes_per_s
        self.requests: list[tuple[str, str]] = []  # (path, Range header or "")
        super().__init__((address, port), RangeHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def __enter__(self) -> MirrorServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class RangeHandler(SimpleHTTPRequestHandler):
    server: MirrorServer

    def __init__(self, request, client_address, server: MirrorServer):
        super().__init__(request, client_address, server, directory=str(server.root))

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.requests.append((self.path, self.headers.get("Range", "")))
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        match = RANGE.match(self.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        with path.open("rb") as handle:
            handle.seek(start)
            left = end - start + 1
            while left > 0:
                block = handle.read(min(64 * 1024, left))
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client was killed: exactly what the resume test does
                left -= len(block)
                if self.server.bytes_per_s:
                    time.sleep(len(block) / self.server.bytes_per_s)
