"""The lab fleet's inventory (lab/fleet.py): members, the router host, drain URLs; no lab needed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import fleet, nspawn  # noqa: E402


@pytest.fixture
def two_labs(tmp_path, monkeypatch):
    """State files of two labs as lab.nspawn writes them, in a folder of their own."""
    monkeypatch.setattr(nspawn, "LABS_DIR", tmp_path)
    for name, address, port in (("flx", "127.150.1.1", 2401), ("flx2", "127.151.1.1", 2402)):
        state = nspawn.LabState(name=name, address=address, ssh_port=port, lab_dir=str(tmp_path / name),
                                loop_device=f"/dev/loop{port % 10}")
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text(json.dumps(asdict(state)))
    fleet.fleet_file("flx").write_text(json.dumps({"members": fleet.member_names("flx", 2)}))
    return tmp_path


def test_members_are_the_lab_then_numbered_labs():
    assert fleet.member_names("flt", 3) == ["flt", "flt2", "flt3"]
    with pytest.raises(nspawn.LabError, match="at least one host"):
        fleet.member_names("flt", 0)


def test_inventory_merges_the_labs_and_the_first_routes_for_all(two_labs):
    inventory = fleet.inventory("flx")
    hosts = inventory["lab"]["hosts"]
    assert len(hosts) == 2 and inventory["gptoss_hosts"] == {"children": ["lab"]}
    first, second = (inventory["_meta"]["hostvars"][h] for h in hosts)
    assert inventory["fleet_router"]["hosts"] == [hosts[0]]
    assert first["router_enabled"] is True and first["router_workers_group"] == "gptoss_hosts"
    assert "router_enabled" not in second
    assert first["vllm_service_drain_router_url"] == second["vllm_service_drain_router_url"] == "http://127.150.1.1:8100"
    assert (first["gptoss_lab_address"], second["gptoss_lab_address"]) == ("127.150.1.1", "127.151.1.1")
    assert sorted(inventory["lab_bookworm"]["hosts"]) == sorted(hosts)


def test_no_fleet_is_an_empty_inventory_and_the_script_says_so(tmp_path):
    env = {"GPTOSS_LAB": "nofleet", "GPTOSS_LAB_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(ROOT / "inventory" / "fleet.py"), "--list"], env=env,
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["lab"]["hosts"] == []
    assert "no fleet is up" in proc.stderr
