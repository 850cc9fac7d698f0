"""A light, counted load of completions for the lab tests that change a server while it serves (the
replicas' rolling restart, the fleet's drills). In-process threads, not `invoke bench` subprocesses: a
bench process per batch cost the replicas test ~160 CPU-s on the controller in a 2-core run, and what
these tests assert is that no request fails and how long answers stopped, which this counts per request."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request


def complete(url: str, max_tokens: int = 16, timeout: float = 120, **extra) -> tuple[bool, str]:
    """One completion of the tiny model through `url`: (answered with at least one token, why not)."""
    body = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": max_tokens, **extra}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] >= 1, "ok"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
    except (OSError, ValueError, KeyError) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200]


class Load:
    """Completions through `url` from `concurrency` loops (120 s client timeout) until stopped, each loop
    waiting `pause_s` after every answer: every request is counted, with its start and end, so failures,
    p95 and gaps come from the same record."""

    def __init__(self, url: str, concurrency: int = 2, stagger_s: float = 0.0, pause_s: float = 0.0, **request):
        self.url, self.request, self.stop, self.pause_s = url, request, threading.Event(), pause_s
        self.results: list[tuple[float, float, bool, str]] = []
        self.threads = [threading.Thread(target=self.run, args=(number * stagger_s,), daemon=True)
                        for number in range(concurrency)]

    def run(self, delay_s: float = 0.0) -> None:
        self.stop.wait(delay_s)
        while not self.stop.is_set():
            started = time.time()
            ok, why = complete(self.url, **self.request)
            self.results.append((started, time.time(), ok, why))
            # counted; a refused connection is not retried in a busy loop
            self.stop.wait(self.pause_s if ok else max(self.pause_s, 0.5))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=150)

    def summary(self) -> dict:
        good = sorted(end for _, end, ok, _ in self.results if ok)
        latencies = sorted(end - start for start, end, ok, _ in self.results if ok)
        gaps = [b - a for a, b in zip(good, good[1:], strict=False)]
        return {"requests": len(self.results), "failed": sum(1 for r in self.results if not r[2]),
                "errors": sorted({r[3] for r in self.results if not r[2]})[:3],
                "longest_gap_s": round(max(gaps), 2) if gaps else None,
                "p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 2) if latencies else None,
                "median_s": round(statistics.median(latencies), 2) if latencies else None,
                "span_s": round(good[-1] - good[0], 1) if good else 0.0}
