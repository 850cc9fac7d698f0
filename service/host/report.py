"""One row of a host report: the one type that verify's checks (service.host.checks) and preflight's
items (service.host.preflight) both return. Standard library only.

A row is an id, a title, a status (each report has its own set: checks.STATUSES, preflight.STATUSES)
and three texts: what should be there, what was found, and a reason (verify: why this status;
preflight: what to do about it). Each report keeps the JSON keys its readers know: verify writes
expected/found/reason, preflight found/need/fix (`to_dict(PREFLIGHT_COLUMNS)`).
"""

from __future__ import annotations

from dataclasses import dataclass

# JSON key -> field, in the order each report writes them.
VERIFY_COLUMNS = (("expected", "expected"), ("found", "found"), ("reason", "reason"))
PREFLIGHT_COLUMNS = (("found", "found"), ("need", "expected"), ("fix", "reason"))


@dataclass
class ReportRow:
    id: str
    title: str
    status: str
    expected: str = ""
    found: str = ""
    reason: str = ""

    def to_dict(self, columns: tuple[tuple[str, str], ...] = VERIFY_COLUMNS) -> dict[str, str]:
        return {"id": self.id, "title": self.title, "status": self.status,
                **{key: getattr(self, name) for key, name in columns}}
