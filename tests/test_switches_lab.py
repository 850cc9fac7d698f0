"""Issue 27: a switch turned off turns its feature off, proven from the lab's live state.

On the session lab: the router and the TLS proxy switched on with an API key (the UI's switch is
tested the same way in tests/test_webui.py, where its wheelhouse is), then one converge as a user runs
it with those switches back off and every host role's switch off too. Afterwards nothing of the
features runs or listens, the proxy's port is closed, the host roles' verify records are gone and
`invoke verify` passes (their checks skip); the same switches again change nothing. Last, vLLM's own
switch off takes its units away. The module puts the lab back as the session converged it.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest
from conftest import ROOT, Lab, record_timing, run_invoke

API_KEY = "switches-lab-key-0123456789abcdef"
ON = {"router_enabled": True, "reverse_proxy_enabled": True, "vllm_service_api_key": API_KEY}
# The host roles that are on by default; each says what it leaves when switched off.
HOST_SWITCHES = ["cpu_governor", "kernel_cmdline", "model_mount", "model_weights", "nccl_env", "nvidia_driver"]
OFF = {f"{role}_enabled": False for role in HOST_SWITCHES}
FEATURE_PORTS = {8443: "proxy", 8100: "router", 29000: "router metrics", 8080: "UI"}
WAIVERS = str(ROOT / "inventory" / "lab-waivers.json")


def listeners(lab: Lab) -> set[tuple[str, str]]:
    """(local address:port, process) of every TCP listener a process of this lab holds below the
    ephemeral range (vLLM's engine takes a fresh ephemeral port at each start). The labs share the
    machine's network; `ss -p` in the lab names only the lab's own processes (its PID namespace)."""
    out = lab.sh("ss -Hltnp")
    found = set()
    for line in out.splitlines():
        fields = line.split()
        owner = re.search(r'users:\(\("([^"]+)"', line)
        if owner and len(fields) >= 4 and int(fields[3].rpartition(":")[2]) < 32768:
            found.add((fields[3], owner.group(1)))
    return found


def on_ports(lab: Lab, ports) -> list[str]:
    """Listeners on these ports at the lab's address or any address (whoever holds them)."""
    address = lab.state.address
    lines = lab.sh("ss -Hltn").splitlines()
    return [line for line in lines for port in ports
            if re.search(rf"\s({re.escape(address)}|0\.0\.0\.0|\*|\[::\]):{port}\s", line)]


def https_get(url: str, token: str = "") -> tuple[int, bytes]:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the lab's self-signed certificate
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def refused(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except (ConnectionRefusedError, OSError):
        return True
    return False


@pytest.fixture(scope="module")
def switched(lab: Lab):
    """Baseline listeners; the switches on (one play), then off as a user turns them off (one converge)."""
    baseline = listeners(lab)
    on = lab.play("playbooks/vllm.yml", extra_vars=ON)
    assert on.rc == 0, on.output[-5000:]
    record_timing("switches_on", on.seconds)
    yield baseline, on
    # The lab as the session converged it (vLLM's switch is on again by default, the host roles too).
    restored = lab.play("site.yml")
    assert restored.rc == 0, restored.output[-5000:]
    record_timing("switches_restore", restored.seconds)


def test_with_the_switches_on_health_is_the_upstreams_and_metrics_are_not_published(lab: Lab, switched):
    base = f"https://{lab.state.address}:8443"
    assert lab.sh("systemctl is-active nginx gptoss-router").split() == ["active", "active"]
    status, body = https_get(f"{base}/health")
    # The router's (or vLLM's) own answer: never another application's JSON or page.
    assert status == 200 and b"<html" not in body.lower() and b'"status":true' not in body.replace(b" ", b"")
    assert https_get(f"{base}/metrics")[0] == 404
    assert https_get(f"{base}/v1/models")[0] == 401
    assert https_get(f"{base}/v1/models", token=API_KEY)[0] == 200
    assert lab.sh("cat /var/lib/gptoss/reverse_proxy-nginx.json").startswith('{"installed_by": "reverse_proxy"')


@pytest.fixture(scope="module")
def turned_off(lab: Lab, switched):
    off = lab.play("site.yml", extra_vars=OFF)
    assert off.rc == 0, off.output[-5000:]
    record_timing("switches_off", off.seconds)
    return off


def test_turned_off_nothing_of_the_features_runs_or_listens(lab: Lab, switched, turned_off):
    baseline, _ = switched
    address = lab.state.address
    gone = ["/etc/nginx/sites-enabled/gptoss-proxy.conf", "/etc/nginx/sites-available/gptoss-proxy.conf",
            "/etc/gptoss/tls", "/etc/systemd/system/gptoss-router.service", "/etc/gptoss/router.json",
            "/opt/gptoss/router-venv",
            "/etc/gptoss/router-secrets.env", "/etc/gptoss/verify.d/router.json",
            "/etc/systemd/system/gptoss-cpu-governor.service", "/etc/gptoss/nccl.env",
            *[f"/etc/gptoss/verify.d/{role}.json" for role in HOST_SWITCHES]]
    left = lab.sh(" ".join(f"test -e {path} && echo {path};" for path in gone) + " true").split()
    assert left == [], left
    assert API_KEY not in lab.sh("cat /etc/gptoss/vllm-secrets.env")  # vLLM's key file says "no key"
    # nginx: the lab's came from the role (its stamp), and no other site is enabled: stopped and disabled.
    assert lab.ssh("systemctl is-active nginx gptoss-router gptoss-cpu-governor", check=False).stdout.split() == [
        "inactive", "inactive", "inactive"]
    assert lab.ssh("systemctl is-enabled nginx", check=False).stdout.strip() == "disabled"
    assert "nginx stopped and disabled" in turned_off.output
    # The proxy went before vLLM restarted without its key (never a keyless vLLM behind the proxy).
    output = turned_off.output
    assert output.index("TASK [reverse_proxy : Retire the proxy site") < output.index(
        "TASK [vllm_service : Roll out as one transaction")
    # Nothing listens on the features' ports; the lab's own listeners are what they were before.
    assert on_ports(lab, FEATURE_PORTS) == []
    assert listeners(lab) == baseline, (listeners(lab), baseline)
    assert refused(address, 8443) and refused(address, 8100)
    # What each host role leaves, it says.
    assert [role for role in HOST_SWITCHES if f"{role} is off" not in turned_off.output] == []
    # vLLM restarted without the key and without the NCCL file: its environment has neither.
    pid = lab.main_pid()
    environ = lab.sh(f"tr '\\0' '\\n' < /proc/{pid}/environ")
    assert "VLLM_API_KEY" not in environ and "NCCL_IB_DISABLE" not in environ


def test_turned_off_verify_passes_and_skips_the_roles_that_are_off(lab: Lab, turned_off):
    result = run_invoke("verify", "--waivers", WAIVERS, env=lab.env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    for check in ("CPU-001", "ENV-001", "MNT-001", "MDL-001", "DRV-001", "RTR-001", "WEB-001"):
        assert re.search(rf"{check}\s+SKIP", result.stdout), result.stdout[-4000:]
    assert re.search(r"API-003\s+PASS", result.stdout)


def test_turned_off_again_changes_nothing(lab: Lab, turned_off):
    tags = ",".join(["reverse_proxy", "router", "webui", *HOST_SWITCHES])
    again = lab.play("site.yml", "--tags", tags, extra_vars={**OFF, "gptoss_base_receipt": False})
    assert again.rc == 0 and again.recap["changed"] == 0, again.output[-4000:]
    record_timing("switches_off_again", again.seconds)


def test_vllms_own_switch_off_takes_its_units_away(lab: Lab, turned_off):
    started = time.monotonic()
    off = lab.play("playbooks/vllm.yml", "--tags", "vllm_service", extra_vars={"vllm_service_enabled": False})
    assert off.rc == 0, off.output[-4000:]
    assert "vllm_service is off: no vLLM unit runs" in off.output
    left = lab.sh("ls /etc/systemd/system/gptoss-vllm*.service /etc/gptoss/vllm-args*.json "
                  "/etc/gptoss/verify.d/vllm_service*.json /var/lib/gptoss/vllm-started*.json 2>/dev/null || true")
    assert left.split() == []
    assert lab.ssh("systemctl is-active gptoss-vllm", check=False).stdout.strip() == "inactive"
    assert refused(lab.state.address, 8000)
    # The venvs stay (on purpose, said above): a switch back on needs no rebuild.
    assert lab.sh("test -x /opt/gptoss/venv/bin/python && echo kept").strip() == "kept"
    again = lab.play("playbooks/vllm.yml", "--tags", "vllm_service", extra_vars={"vllm_service_enabled": False})
    assert again.rc == 0 and again.recap["changed"] == 0, again.output[-4000:]
    record_timing("switches_vllm_off", time.monotonic() - started)
