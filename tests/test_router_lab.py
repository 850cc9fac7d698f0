"""The router role on the session lab: vllm-router in front of the lab's vLLM (issue 19).

Reuses the session's converged lab and runs only the router role (no vLLM restart): install from
the offline wheelhouse, the key never on a command line, the router lists the inventory's workers,
a completion through it, a second run changes nothing, and a bad policy changes nothing.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.request

import pytest
from conftest import Lab, record_timing

ROUTER_KEY = "router-lab-key-0123456789abcdef"
ROUTER_VARS = {"router_enabled": True, "router_api_key": ROUTER_KEY}


@pytest.fixture(scope="module")
def routed(lab: Lab):
    started = time.monotonic()
    first = lab.play("playbooks/vllm.yml", "--tags", "router", extra_vars=ROUTER_VARS)
    assert first.rc == 0, first.output[-5000:]
    record_timing("router_converge_first", time.monotonic() - started)
    yield first
    # nginx only if the proxy test started it (it pointed at the router).
    lab.ssh("systemctl disable --now gptoss-router.service; "
            "test -e /etc/nginx/sites-enabled/gptoss-proxy.conf && systemctl disable --now nginx", check=False)


def test_router_serves_the_inventorys_workers_with_the_key_off_the_command_line(lab: Lab, routed):
    second = lab.play("playbooks/vllm.yml", "--tags", "router", extra_vars=ROUTER_VARS)
    assert second.rc == 0 and second.recap["changed"] == 0, second.output[-4000:]
    record_timing("router_converge_noop", second.seconds)
    address = lab.state.address
    listed = json.loads(urllib.request.urlopen(f"http://{address}:8100/list_workers", timeout=10).read())
    assert listed["urls"] == [f"http://{address}:8000"]
    check = json.loads(lab.sh("PYTHONPATH=/opt/gptoss/lib python3 -m service.host.router_check"))
    assert check["ok"] and check["missing"] == [] and check["unexpected"] == []
    body = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 3}).encode()
    request = urllib.request.Request(f"http://{address}:8100/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] >= 1
    pid = lab.sh("systemctl show -p MainPID --value gptoss-router").strip()
    assert ROUTER_KEY not in lab.sh(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert ROUTER_KEY not in lab.sh("ps -eo args; cat /etc/gptoss/router.json "
                                    "/etc/systemd/system/gptoss-router.service")
    assert ROUTER_KEY not in routed.output + second.output
    assert lab.sh("stat -c '%a %U' /etc/gptoss/router-secrets.env").split() == ["600", "root"]
    # systemctl show prints the properties in its own order, not in the order asked.
    shown = lab.sh("systemctl show -p DynamicUser -p NoNewPrivileges -p ProtectSystem gptoss-router").split()
    assert sorted(shown) == [
        "DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict"]
    assert lab.sh("stat -c '%U' /proc/" + pid).strip() != "root"
    # Installed offline from the shared wheelhouse, at the pinned version.
    assert lab.sh("/opt/gptoss/router-venv/bin/python -c \"import importlib.metadata as m; "
                  "print(m.version('vllm-router'))\"").strip() == "0.1.17"


def test_a_bad_policy_is_refused_and_nothing_changes(lab: Lab, routed):
    watched = ["/etc/gptoss/router.json", "/etc/systemd/system/gptoss-router.service"]
    before = lab.checksums(*watched)
    pid = lab.sh("systemctl show -p MainPID --value gptoss-router").strip()
    bad = lab.play("playbooks/vllm.yml", "--tags", "router", extra_vars={**ROUTER_VARS, "router_policy": "fastest"})
    assert bad.rc != 0
    assert "router_policy" in bad.output and "fastest" in bad.output
    assert lab.checksums(*watched) == before
    assert lab.sh("systemctl show -p MainPID --value gptoss-router").strip() == pid


# The router's admin endpoints (seen in vllm-router 0.1.17's binary), and paths that normalise to one
# of them, or to /v1/ from one of them; none may reach the router through the proxy.
ADMIN_PATHS = ["/remove_worker?url=http://{address}:8000", "/add_worker?url=http://{address}:9",
               "/list_workers", "/workers", "/flush_cache", "/get_loads", "/start_profile",
               "/v1/../remove_worker?url=http://{address}:8000", "/v1/%2e%2e/remove_worker?url=http://{address}:8000",
               "//remove_worker?url=http://{address}:8000", "/remove_worker/../v1/models",
               "/remove_worker/..%2Fv1/models?url=http://{address}:8000", "/v1/./../list_workers"]


def test_the_reverse_proxy_hides_the_routers_admin_endpoints(lab: Lab, routed, tmp_path):
    address = lab.state.address
    started = time.monotonic()
    proxied = lab.play("playbooks/vllm.yml", "--tags", "reverse_proxy",
                       extra_vars={**ROUTER_VARS, "reverse_proxy_enabled": True,
                                   "vllm_service_api_key": ROUTER_KEY})
    assert proxied.rc == 0, proxied.output[-4000:]
    record_timing("router_reverse_proxy", time.monotonic() - started)
    cert = tmp_path / "proxy.crt"
    cert.write_text(lab.sh("cat /etc/gptoss/tls/proxy.crt"))
    context = ssl.create_default_context(cafile=str(cert))

    def status(method: str, path: str) -> int:
        # http.client sends the path as given (no normalisation on our side).
        connection = http.client.HTTPSConnection(address, 8443, timeout=30, context=context)
        try:
            connection.request(method, path)
            return connection.getresponse().status
        finally:
            connection.close()

    assert status("GET", "/v1/models") == 200
    assert status("GET", "/health") == 200
    for path in ADMIN_PATHS:
        for method in ("GET", "POST"):
            assert status(method, path.format(address=address)) in (400, 404), (method, path)
    # Straight at the router (loopback side) the worker is still listed: nothing went through.
    listed = json.loads(urllib.request.urlopen(f"http://{address}:8100/list_workers", timeout=10).read())
    assert listed["urls"] == [f"http://{address}:8000"]
