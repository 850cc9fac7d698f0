"""What apt offers, read from `apt-cache policy` and `apt-get update`, and the rule that decides
whether a package can be installed at or above a required version.

Standard library only (shipped to the managed host). The text formats parsed here are apt's
C-locale output; the callers run apt with LC_ALL=C. tests/data/apt/ holds real captured output.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ansible_collections.gptoss.host.plugins.module_utils.debian_version import driver_at_least

_VERSION_LINE = re.compile(r"^(?: {5}| \*\*\* )(\S+) (-?\d+)$")
_SOURCE_LINE = re.compile(r"^ {8}(-?\d+) (.+)$")
_PACKAGE_FILE_LINE = re.compile(r"^ *(-?\d+) (\S.*)$")
# How apt-get update names a source it could not use: unreachable, unsigned, or a key it lacks.
_UPDATE_PROBLEMS = [
    re.compile(r"^[WE]: Failed to fetch (\S+)\s+(.*)$"),
    re.compile(r"^[WE]: The repository '(\S+)[^']*' (.*)$"),
    re.compile(r"^[WE]: GPG error: (\S+)\s+\S*:?\s*(.*)$"),
]


@dataclass
class VersionOffer:
    version: str
    priority: int
    # apt's source lines ("http://host/debian bookworm/non-free amd64 Packages"); dpkg's status
    # file, which only says "installed", is left out.
    sources: list[str] = field(default_factory=list)
    installed: bool = False


@dataclass
class PackagePolicy:
    name: str
    installed: str | None
    candidate: str | None
    offers: list[VersionOffer] = field(default_factory=list)


def _none_if_absent(value: str) -> str | None:
    return None if value in ("(none)", "") else value


def parse_policy(text: str) -> dict[str, PackagePolicy]:
    """`apt-cache policy PKG...` -> one PackagePolicy per package apt knows (unknown ones are absent)."""
    policies: dict[str, PackagePolicy] = {}
    current: PackagePolicy | None = None
    offer: VersionOffer | None = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = PackagePolicy(name=line[:-1], installed=None, candidate=None)
            policies[current.name] = current
            offer = None
        elif current is None:
            continue
        elif line.startswith("  Installed: "):
            current.installed = _none_if_absent(line.split(": ", 1)[1].strip())
        elif line.startswith("  Candidate: "):
            current.candidate = _none_if_absent(line.split(": ", 1)[1].strip())
        elif match := _VERSION_LINE.match(line):
            offer = VersionOffer(version=match.group(1), priority=int(match.group(2)),
                                 installed=line.startswith(" *** "))
            current.offers.append(offer)
        elif (match := _SOURCE_LINE.match(line)) and offer is not None:
            source = match.group(2).strip()
            if source != "/var/lib/dpkg/status":
                offer.sources.append(source)
    return policies


def parse_package_files(text: str) -> list[str]:
    """`apt-cache policy` (no arguments) -> the package lists apt has read, one line per list."""
    files: list[str] = []
    in_section = False
    for line in text.splitlines():
        if line.startswith("Package files:"):
            in_section = True
        elif line.startswith("Pinned packages:"):
            in_section = False
        elif in_section and (match := _PACKAGE_FILE_LINE.match(line)):
            source = match.group(2).strip()
            if not source.startswith(("release ", "origin ")) and source != "/var/lib/dpkg/status":
                files.append(source)
    return files


def parse_update_failures(text: str) -> list[tuple[str, str]]:
    """(url, reason) for every source `apt-get update` could not fetch or could not trust."""
    failures = []
    for line in text.splitlines():
        for pattern in _UPDATE_PROBLEMS:
            if match := pattern.match(line.strip()):
                failures.append((match.group(1), match.group(2).strip()))
                break
    return failures


def _norm_url(url: str) -> str:
    return url.rstrip("/")


@dataclass
class PackageVerdict:
    name: str
    known: bool
    installed: str | None
    candidate: str | None
    candidate_sources: list[str]
    candidate_meets: bool
    # The highest version any configured source offers at or above the requirement (None: none does).
    best_offer: str | None
    best_offer_sources: list[str]


@dataclass
class CandidateDecision:
    required: str
    ok: bool
    packages: list[PackageVerdict]
    unreadable_sources: list[dict[str, str]]
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def _verdict(name: str, policy: PackagePolicy | None, required: str) -> PackageVerdict:
    if policy is None:
        return PackageVerdict(name, False, None, None, [], False, None, [])
    candidate_sources = next((o.sources for o in policy.offers if o.version == policy.candidate), [])
    good = [o for o in policy.offers if o.sources and driver_at_least(o.version, required)]
    best = good[0] if good else None  # apt lists versions highest first
    return PackageVerdict(
        name=name, known=True, installed=policy.installed, candidate=policy.candidate,
        candidate_sources=candidate_sources,
        candidate_meets=policy.candidate is not None and driver_at_least(policy.candidate, required),
        best_offer=best.version if best else None, best_offer_sources=best.sources if best else [],
    )


def unreadable_sources(managed_urls: list[str], package_files: list[str],
                       update_failures: list[tuple[str, str]]) -> list[dict[str, str]]:
    """Managed repositories apt has no package list for, with apt-get update's reason when it gave one."""
    unreadable = []
    for url in managed_urls:
        base = _norm_url(url)
        if any(_norm_url(line.split()[0]) == base or line.startswith(base + "/") or line.startswith(base + " ")
               for line in package_files):
            continue
        reasons = [reason for failed, reason in update_failures if failed.startswith(base)]
        unreadable.append({"url": url, "reason": reasons[0] if reasons else
                           "apt has no package list for it (apt-get update never read it)"})
    return unreadable


def decide(policies: dict[str, PackagePolicy], packages: list[str], required: str,
           managed_urls: list[str] | None = None, package_files: list[str] | None = None,
           update_failures: list[tuple[str, str]] | None = None, label: str = "apt_candidate",
           fix: str = "") -> CandidateDecision:
    """The rule: every package's candidate (what apt would install now, pins and all) must carry a
    version at or above `required`. Anything else is a refusal, explained source by source."""
    verdicts = [_verdict(name, policies.get(name), required) for name in packages]
    unreadable = unreadable_sources(managed_urls or [], package_files or [], update_failures or [])
    ok = all(v.candidate_meets for v in verdicts)
    if ok:
        message = f"{label}: " + "; ".join(
            f"{v.name} {v.candidate} from {', '.join(v.candidate_sources) or 'an installed package'}"
            for v in verdicts) + f" (>= {required})"
        return CandidateDecision(required, True, verdicts, unreadable, message)
    lines = [f"{label}: refusing to install: no configured apt source offers a candidate at or above "
             f"{required} for every package; nothing was installed."]
    for v in verdicts:
        if not v.known or v.candidate is None:
            lines.append(f"- {v.name}: no configured apt source offers it.")
        elif not v.candidate_meets and v.best_offer:
            lines.append(f"- {v.name}: apt's candidate is {v.candidate} ({', '.join(v.candidate_sources)}), "
                         f"below {required}, although {', '.join(v.best_offer_sources)} offers {v.best_offer}: "
                         f"an apt pin or priority prefers the older one.")
        elif not v.candidate_meets:
            lines.append(f"- {v.name}: apt's candidate is {v.candidate} from "
                         f"{', '.join(v.candidate_sources) or 'no source'}, below {required}.")
        else:
            lines.append(f"- {v.name}: candidate {v.candidate} is fine.")
    for item in unreadable:
        lines.append(f"- the repository {item['url']} could not be read: {item['reason']}.")
    if fix:
        lines.append(f"Fix: {fix}")
    return CandidateDecision(required, False, verdicts, unreadable, "\n".join(lines))


def driver_status(installed: str | None, loaded: str | None, required: str) -> dict[str, object]:
    """After an install: is the package at the requirement, and is the loaded module? A loaded
    module below it while the package is fine means the new driver waits for a reboot."""
    installed_meets = bool(installed) and driver_at_least(installed, required)
    loaded_meets = bool(loaded) and driver_at_least(loaded, required)
    return {"installed_meets": installed_meets, "loaded_meets": loaded_meets,
            "reboot_required": installed_meets and not loaded_meets}
