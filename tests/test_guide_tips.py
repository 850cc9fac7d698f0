"""docs/guide-tips.md: one row per published-guide tip, each with a verdict and evidence that exists.

The tip IDs are written here (the guides' notes live outside this repository). A verify check ID the
page names must be a check of `service/host/checks.py`, and a repository path it names in backticks
must exist, so a renamed check, file or test breaks this test instead of leaving the page wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guide-tips.md"
CHECKS = REPO / "service" / "host" / "checks.py"

TIP_IDS = (
    [f"A{n}" for n in range(1, 20)]
    + [f"B{n}" for n in range(1, 5)]
    + [f"C{n}" for n in range(1, 8)]
    + [f"D{n}" for n in range(1, 7)]
)
VERDICTS = {"applied", "corrected", "refused", "measured", "no effect / not applicable", "not handled"}
CHECK_ID = re.compile(r"\b[A-Z]{3}-\d{3}\b")
BACKTICKED = re.compile(r"`([^`\n]+)`")


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row; a `|` inside backticks is not a cell border."""
    cells, cell, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    cells.append(cell.strip())
    return cells


def tip_rows(text: str) -> dict[str, list[list[str]]]:
    rows: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = split_row(line)
        if re.fullmatch(r"[A-D]\d{1,2}", cells[0]):
            rows.setdefault(cells[0], []).append(cells)
    return rows


def repo_paths(text: str) -> list[str]:
    """Backticked tokens that name a file or folder of this repository (optionally `file::test`)."""
    found = []
    for token in BACKTICKED.findall(text):
        if " " in token or "/" not in token or token.startswith(("/", "~", "$", "http")):
            continue
        if ":" in token.replace("::", "") or "*" in token:
            continue  # metric names, globs
        found.append(token)
    return found


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_every_tip_has_exactly_one_row_with_a_verdict_and_evidence(page: str) -> None:
    rows = tip_rows(page)
    assert sorted(rows) == sorted(TIP_IDS), f"missing {set(TIP_IDS) - set(rows)}, unknown {set(rows) - set(TIP_IDS)}"
    for tip, found in rows.items():
        assert len(found) == 1, f"{tip}: {len(found)} rows"
        cells = found[0]
        assert len(cells) == 5, f"{tip}: expected 5 cells (ID, tip, verdict, what we do, evidence), got {len(cells)}"
        _, tip_text, verdict, action, evidence = cells
        assert verdict.strip("*_ ") in VERDICTS, f"{tip}: verdict {verdict!r} not one of {sorted(VERDICTS)}"
        assert tip_text and action, f"{tip}: empty tip or action"
        assert evidence, f"{tip}: no evidence"


def test_named_verify_checks_exist(page: str) -> None:
    known = set(re.findall(r'\("([A-Z]{3}-\d{3})",', CHECKS.read_text()))
    assert known, "no check IDs found in service/host/checks.py"
    named = set(CHECK_ID.findall(page))
    assert named, "the page names no verify check"
    assert named <= known, f"not checks of service/host/checks.py: {sorted(named - known)}"


def test_named_repository_paths_and_tests_exist(page: str) -> None:
    paths = repo_paths(page)
    assert paths, "the page names no repository path"
    for token in paths:
        path, _, test_name = token.partition("::")
        target = REPO / path
        assert target.exists(), f"{path} does not exist in the repository"
        if test_name:
            assert re.search(rf"^def {re.escape(test_name)}\(", target.read_text(), re.M), (
                f"{test_name} is not a test function of {path}"
            )

