"""Alertmanager's local receiver: each notification's alerts as one journal line each.

A fresh host has no webhook or mail relay configured, yet its alerts must show somewhere: Alertmanager
posts them here (its webhook format, version 4) and this writes them to stdout, which systemd puts in
the journal (`journalctl -u gptoss-alert-receiver`). Firing alerts at priority warning, resolved ones at
notice (systemd reads the `<N>` prefix). Standard library only; it runs as the unit's dynamic user.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Alertmanager's notifications are small; a larger body is not one of them.
MAX_BODY = 1 << 20
PRIORITY = {"firing": 4, "resolved": 5}  # syslog warning, notice


def alert_lines(payload: dict) -> list[str]:
    """One line per alert: '<4>FIRING VllmDown host=lab1 severity=critical: summary (since ...)'."""
    lines = []
    for alert in payload.get("alerts") or []:
        status = str(alert.get("status") or payload.get("status") or "firing")
        labels = dict(alert.get("labels") or {})
        annotations = dict(alert.get("annotations") or {})
        name = labels.pop("alertname", "?")
        shown = " ".join(f"{key}={labels[key]}" for key in sorted(labels))
        text = annotations.get("summary") or annotations.get("description") or ""
        when = alert.get("startsAt", "") if status == "firing" else alert.get("endsAt", "")
        line = f"{status.upper()} {name} {shown}: {text} ({'since' if status == 'firing' else 'ended'} {when})"
        lines.append(f"<{PRIORITY.get(status, 4)}>" + " ".join(line.split()))
    return lines


class Receiver(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the alerts are the log, not the requests
        pass

    def _answer(self, code: int, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # a health probe
        self._answer(200, "gptoss alert receiver\n")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(413 if length else 400, "no body or too large\n")
            return
        try:
            payload = json.loads(self.rfile.read(length))
            lines = alert_lines(payload if isinstance(payload, dict) else {})
        except (ValueError, TypeError, AttributeError) as err:
            print(f"<3>unreadable notification: {err}", flush=True)
            self._answer(400, "not an Alertmanager notification\n")
            return
        for line in lines:
            print(line, flush=True)
        self._answer(200, "ok\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:9095", help="address:port (default %(default)s)")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host.strip("[]"), int(port)), Receiver)
    print(f"<6>listening on {args.listen}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
