"""``python3 -m service.host.verify``: run the live-state checks on this host and report them.

Reads ``/etc/gptoss/verify.d/<role>.json`` (what each role promised). The keys of each role's file,
what they mean and which check reads them are the verify contract:
``collections/ansible_collections/gptoss/host/plugins/module_utils/verify_contract.py``. A file that
breaks it (unknown role or key, missing key, wrong type) is a configuration error (exit 2). One record per
instance (``vllm_service@<name>.json``) keeps the ``vllm_service`` contract.

Exit codes: 0 every check passed (skips and waived ones are fine), 1 a check failed (status fail),
2 a tool or host error: the tool itself could not work (bad config dir, unreadable JSON, bad waivers)
or a check could not run (status error, e.g. systemd or the key file unreadable). Error wins over fail.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from service.host import checks

DEFAULT_CONFIG_DIR = Path("/etc/gptoss/verify.d")
FAILING = ("fail", "error")
# Widest a table cell gets before it is cut; the reason column is never cut.
CELL_WIDTH = {"title": 44, "expected": 40, "found": 48}


# ------------------------------------------------------------------ waivers


def load_waivers(path: str | Path) -> list[dict[str, str]]:
    """A JSON list of {"id", "reason", "expires"?: "YYYY-MM-DD"}; ConfigError on anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise checks.ConfigError(f"waivers {path}: {err}") from err
    if not isinstance(data, list):
        raise checks.ConfigError(f"waivers {path}: expected a JSON list of objects")
    waivers = []
    for n, item in enumerate(data):
        where = f"waivers {path} entry {n}"
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            raise checks.ConfigError(f"{where}: needs an 'id'")
        if item["id"] not in checks.CHECK_IDS:
            raise checks.ConfigError(f"{where}: unknown check id {item['id']!r}")
        if not str(item.get("reason") or "").strip():
            raise checks.ConfigError(f"{where} ({item['id']}): a waiver needs a non-empty reason")
        expires = item.get("expires")
        if expires is not None:
            try:
                dt.date.fromisoformat(str(expires))
            except ValueError as err:
                raise checks.ConfigError(f"{where} ({item['id']}): expires {expires!r} is not YYYY-MM-DD") from err
        waivers.append({"id": item["id"], "reason": str(item["reason"]).strip(),
                        **({"expires": str(expires)} if expires is not None else {})})
    return waivers


def apply_waivers(results: list[dict[str, Any]], waivers: list[dict[str, str]],
                  today: dt.date | None = None) -> list[str]:
    """Mark waived failing results 'waived' (in place); returns notes about expired waivers."""
    today = today or dt.date.today()
    notes = []
    for waiver in waivers:
        expires = waiver.get("expires")
        if expires and dt.date.fromisoformat(expires) < today:
            notes.append(f"waiver for {waiver['id']} expired on {expires}: ignored")
            for result in results:
                if result["id"] == waiver["id"]:
                    result["reason"] = (result["reason"] + "; " if result["reason"] else "") + \
                        f"waiver expired {expires}"
            continue
        for result in results:
            if result["id"] == waiver["id"] and result["status"] in FAILING:
                result["waived_status"] = result["status"]
                result["status"] = "waived"
                result["waiver"] = waiver["reason"]
    return notes


# ------------------------------------------------------------------ output


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {s: 0 for s in (*checks.STATUSES, "waived")}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    return {**counts, "total": len(results), "ok": counts["fail"] == 0 and counts["error"] == 0}


def _cell(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(results: list[dict[str, Any]]) -> str:
    rows = [["ID", "STATUS", "TITLE", "EXPECTED", "FOUND", "REASON"]]
    for r in results:
        reason = r["reason"] + (f" [waived: {r['waiver']}]" if r.get("waiver") else "")
        rows.append([r["id"], r["status"].upper(), _cell(r["title"], CELL_WIDTH["title"]),
                     _cell(r["expected"], CELL_WIDTH["expected"]), _cell(r["found"], CELL_WIDTH["found"]), reason])
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5]
                     for row in rows).rstrip()


def format_summary(summary: dict[str, Any], seconds: float | None = None) -> str:
    parts = [f"{summary[s]} {s}" for s in ("pass", "fail", "error", "skip", "waived") if summary[s]]
    timing = f" in {seconds:.2f} s" if seconds is not None else ""
    return f"{'OK' if summary['ok'] else 'FAILED'}: {', '.join(parts) or 'no checks'}{timing}"


def junit_xml(reports: dict[str, dict[str, Any]]) -> bytes:
    """One <testsuite> per host, one <testcase> per check; waived is skipped with its reason."""
    suites = ET.Element("testsuites", name="gptoss-verify")
    for host, report in reports.items():
        results = report.get("results", [])
        summary = summarize(results)
        suite = ET.SubElement(suites, "testsuite", name=f"verify {host}", tests=str(len(results)),
                              failures=str(summary["fail"]), errors=str(summary["error"]),
                              skipped=str(summary["skip"] + summary["waived"]))
        if "error" in report:
            case = ET.SubElement(suite, "testcase", classname=host, name="host")
            ET.SubElement(case, "error", message=report["error"])
            suite.set("errors", "1")
            suite.set("tests", "1")
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=host, name=f"{r['id']} {r['title']}")
            detail = f"expected: {r['expected']}\nfound: {r['found']}\nreason: {r['reason']}"
            if r["status"] == "fail":
                ET.SubElement(case, "failure", message=r["reason"] or "failed").text = detail
            elif r["status"] == "error":
                ET.SubElement(case, "error", message=r["reason"] or "error").text = detail
            elif r["status"] == "skip":
                ET.SubElement(case, "skipped", message=r["reason"])
            elif r["status"] == "waived":
                ET.SubElement(case, "skipped", message=f"waived: {r['waiver']}").text = detail
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def exit_code(reports: dict[str, dict[str, Any]]) -> int:
    """0 all pass, 1 a check failed, 2 a tool or host error (an unreachable host, a check that errored)."""
    if any("error" in report for report in reports.values()):
        return 2
    return max((report_exit_code(summarize(r["results"])) for r in reports.values()), default=0)


def report_exit_code(summary: dict[str, Any]) -> int:
    if summary["error"]:
        return 2
    return 1 if summary["fail"] else 0


def report_hosts(reports: dict[str, dict[str, Any]], *, as_json: bool = False, junit: str | None = None,
                 waivers: list[dict[str, str]] | None = None) -> int:
    """Print reports of several hosts (the controller's `invoke verify`), apply waivers, return the exit code."""
    for report in reports.values():
        if "results" in report:
            report.setdefault("notes", []).extend(apply_waivers(report["results"], waivers or []))
            report["summary"] = summarize(report["results"])
    if junit:
        Path(junit).write_bytes(junit_xml(reports))
    if as_json:
        print(json.dumps({"hosts": reports}, indent=2))
    else:
        for host, report in reports.items():
            print(f"== {host}")
            if "error" in report:
                print(f"ERROR: {report['error']}")
                continue
            print(format_table(report["results"]))
            for note in report.get("notes", []):
                print(f"note: {note}")
            print(format_summary(report["summary"], report.get("duration_s")))
    return exit_code(reports)


# ------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m service.host.verify", description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--junit", metavar="PATH", help="also write JUnit XML here")
    parser.add_argument("--no-completion", action="store_true", help="skip API-003 and API-004 (real completions)")
    parser.add_argument("--waivers", metavar="FILE", help="JSON list of {id, reason, expires?}")
    parser.add_argument("--only", metavar="ID,ID", help="run only these check IDs")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="HTTP timeout per request, seconds (a completion, API-003 and API-004, waits at least "
                             f"{checks.COMPLETION_TIMEOUT_S:.0f} s: it queues behind the server's other requests)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The host report; raises ConfigError for exit 2."""
    start = time.monotonic()
    only = {part.strip() for part in args.only.split(",") if part.strip()} if args.only else None
    unknown = sorted(only - set(checks.CHECK_IDS)) if only else []
    if unknown:
        raise checks.ConfigError(f"--only: unknown check id(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(checks.CHECK_IDS)}")
    waivers = load_waivers(args.waivers) if args.waivers else []
    ctx = checks.Context(checks.load_roles(args.config_dir), no_completion=args.no_completion, timeout=args.timeout)
    results = [r.to_dict() for r in checks.run_checks(ctx, only)]
    notes = apply_waivers(results, waivers)
    return {"host": socket.gethostname(), "config_dir": str(args.config_dir), "results": results,
            "summary": summarize(results), "notes": notes, "duration_s": round(time.monotonic() - start, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except checks.ConfigError as err:
        if args.json:
            print(json.dumps({"host": socket.gethostname(), "error": str(err)}))
        print(f"verify: {err}", file=sys.stderr)
        return 2
    if args.junit:
        Path(args.junit).write_bytes(junit_xml({report["host"]: report}))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report["results"]))
        for note in report["notes"]:
            print(f"note: {note}")
        print(format_summary(report["summary"], report["duration_s"]))
    return report_exit_code(report["summary"])


if __name__ == "__main__":
    sys.exit(main())
