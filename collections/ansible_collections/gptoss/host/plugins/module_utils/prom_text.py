"""Samples of a Prometheus text exposition page (/metrics), for the checks that read one (standard library only).

Enough of the format for gauges and counters: `name{label="value",...} number [timestamp]`; comments and
blank lines skipped, label values unescaped (\\\\, \\", \\n). Not a validator: a line it cannot read is skipped.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """[(name, labels, value)] in page order."""
    found = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        labels = {key: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], raw)
                  for key, raw in _LABEL.findall(match.group("labels") or "")}
        found.append((match.group("name"), labels, value))
    return found
