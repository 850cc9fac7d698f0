"""A fleet of labs: N lab hosts as one inventory, the first one running the router for all.

Members of fleet NAME are the labs NAME, NAME2, ... NAMEn (each an ordinary lab from lab.nspawn:
its own address, SSH port and model disk; the shared wheelhouse and tiny model). The fleet's
member list is kept in .lab/fleet-NAME.json so that inventory/fleet.py and `invoke lab.fleet-down`
find them without guessing.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab import nspawn


def member_names(name: str, count: int) -> list[str]:
    if count < 1:
        raise nspawn.LabError(f"a fleet needs at least one host, not {count}")
    return [name] + [f"{name}{index}" for index in range(2, count + 1)]


def fleet_file(name: str) -> Path:
    return nspawn.lab_dir_for(name).parent / f"fleet-{name}.json"


def members(name: str) -> list[str]:
    path = fleet_file(name)
    return json.loads(path.read_text())["members"] if path.exists() else []


def up(name: str, count: int, release: str | None = None) -> list[tuple[nspawn.LabState, str]]:
    """Boot every member (a no-op for those already up) and record the fleet."""
    names = member_names(name, count)
    path = fleet_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"members": names}) + "\n")  # first: fleet-down finds half-booted fleets
    return [nspawn.up(member, release) for member in names]


def down(name: str) -> list[str]:
    """Take every member down (each by its recorded PID), then forget the fleet."""
    said = []
    for member in members(name) or [name]:
        if nspawn.load_state(member) is not None:
            said.append(nspawn.down(member))
    fleet_file(name).unlink(missing_ok=True)
    return said


def inventory(name: str) -> dict:
    """One inventory of all members: every host serves; the first also runs the router for all.

    Each member's own inventory (lab.nspawn.inventory) is merged; the router host gets
    router_enabled with the whole gptoss_hosts group as its workers, and every host drains through it.
    """
    merged: dict = {"_meta": {"hostvars": {}}, "lab": {"hosts": [], "children": []},
                    "gptoss_hosts": {"children": ["lab"]}, "fleet_router": {"hosts": []}}
    router_url = ""
    for member in members(name):
        part = nspawn.inventory(member)
        for host, hostvars in part["_meta"]["hostvars"].items():
            if not router_url:
                router_url = f"http://{hostvars['gptoss_lab_address']}:8100"
                hostvars = {**hostvars, "router_enabled": True, "router_workers_group": "gptoss_hosts"}
                merged["fleet_router"]["hosts"].append(host)
            # One Prometheus (on the router's host) scrapes every member (docs/monitoring.md, "A fleet").
            merged["_meta"]["hostvars"][host] = {**hostvars, "vllm_service_drain_router_url": router_url,
                                                 "monitoring_fleet_group": "gptoss_hosts"}
            merged["lab"]["hosts"].append(host)
        for group, body in part.items():
            if group.startswith("lab_"):
                merged.setdefault(group, {"hosts": []})["hosts"] += body["hosts"]
                if group not in merged["lab"]["children"]:
                    merged["lab"]["children"].append(group)
    return merged
