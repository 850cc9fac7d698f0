"""Issue 14: every failure path of a change leaves the lab serving, and the record and messages true.

One lab (the session's `lab` fixture), real systemd, real vLLM (CPU build). Order matters and is
kept cheap: each real restart costs ~45+ s here, so several must-shows share one converge. The last
test puts the lab back as the fixture left it (no API key) for the test files that run after this one.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.error
import urllib.request

from conftest import ROOT, VENV_BIN, Lab, reasons

INPUTS = ["/etc/systemd/system/gptoss-vllm.service", "/etc/gptoss/vllm-args.json", "/etc/gptoss/vllm-secrets.env",
          "/etc/gptoss/verify.d/vllm_service.json", "/etc/gptoss/nccl.env"]
NO_KEY_FILE = "# no API key: loopback only\n"
# Through ONE real converge (a restart costs minutes here): the key followed by every expansion
# systemd or a shell knows (variables, commands, specifiers, escapes, comments, quotes).
# More awkward keys, and the refused ones, go through the same reader in tests/test_unit_inputs.py.
AWKWARD_KEYS = ['k"e$y #1 \\ x $HOME ${PATH} `id` $(id) %h %n %% \\n \\\\ ;|&<>*?[]{}="']
REFUSED_KEY = "it's-refused-0123456789"


def converge_vllm(lab: Lab, **extra_vars):
    result = lab.play("playbooks/vllm.yml", "--tags", "vllm_service", extra_vars=extra_vars or None)
    print(f"[converge] {sorted(extra_vars)} rc={result.rc} {result.seconds:.1f}s")
    return result


def completion(lab: Lab, key: str | None = None) -> int:
    """HTTP status of one real completion (200 = served) with this Bearer key."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{lab.base_url}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def verify(lab: Lab, only: str) -> tuple[int, dict[str, dict]]:
    proc = lab.ssh(f"cd /opt/gptoss/lib && python3 -m service.host.verify --json --only {only}", check=False)
    return proc.returncode, {r["id"]: r for r in json.loads(proc.stdout)["results"]}


def server_env(lab: Lab, name: str) -> str | None:
    """The variable as the running server really has it (/proc/MainPID/environ)."""
    raw = lab.sh(f"base64 -w0 /proc/{lab.main_pid()}/environ")
    for item in base64.b64decode(raw).split(b"\0"):
        key, _, value = item.partition(b"=")
        if key.decode() == name:
            return value.decode()
    return None


def found_on_lab(lab: Lab, secret: str) -> str:
    """Where `secret` appears in logs and backups on the lab (empty: nowhere). The secrets file is excluded."""
    encoded = base64.b64encode(secret.encode()).decode()
    return lab.sh(
        f"echo {encoded} | base64 -d > /root/.needle; "
        "{ journalctl --no-pager -o cat | grep -qF -f /root/.needle && echo journal; "
        "  grep -rlF -f /root/.needle /var/log /etc/systemd/system /var/lib/gptoss /etc/gptoss "
        "    --exclude=vllm-secrets.env; "
        "  find /etc/gptoss /etc/systemd/system -name '*~' -print0 | xargs -0r grep -lF -f /root/.needle; } "
        "| sort -u; rm -f /root/.needle").strip()


def wait_main_pid_change(lab: Lab, old: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = lab.main_pid()
        if pid not in (0, old):
            return pid
        if lab.sh("systemctl show -p ActiveState --value gptoss-vllm").strip() == "failed":
            return 0
        time.sleep(1)
    raise AssertionError(f"MainPID stayed {old} for {timeout}s")


def test_port_held_by_another_process_is_refused_before_the_server_stops(lab: Lab):
    address = lab.state.address
    lab.sh(f"systemd-run --unit gptoss-test-portholder --collect python3 -m http.server 8001 --bind {address}")
    try:
        holder = int(lab.sh("for i in $(seq 50); do p=$(systemctl show -p MainPID --value gptoss-test-portholder);"
                            " ss -ltnp 'sport = :8001' | grep -q pid=$p && break; sleep 0.2; done; echo $p"))
        before, pid = lab.checksums(*INPUTS), lab.main_pid()
        result = converge_vllm(lab, vllm_service_port=8001)
        assert result.rc != 0
        assert f"{address}:8001 is held by PID {holder} (python3), not by gptoss-vllm.service" in result.output, \
            result.output[-3000:]
        assert "refused before anything changed" in result.output
        assert lab.main_pid() == pid, "the live server was touched"
        assert lab.checksums(*INPUTS) == before
        print(f"[must-show] port conflict: refused in a {result.seconds:.1f}s converge, MainPID {pid} -> "
              f"{lab.main_pid()}")
        assert result.seconds < 120, "a refusal must take seconds, not the rollout timeout"
    finally:
        lab.sh("systemctl stop gptoss-test-portholder; true")
    assert completion(lab) == 200
    code, results = verify(lab, "SVC-001,SVC-003,SVC-004,API-001,API-002,API-003")
    assert code == 0, reasons(results.values())


def test_drift_reported_then_live_through_a_crash_loop_to_the_start_limit_then_a_converge_recovers(lab: Lab):
    env_file = "/etc/gptoss/nccl.env"
    original = lab.sh(f"cat {env_file}")
    name, _, value = next(line for line in original.splitlines() if "=" in line and not line.startswith("#")
                          ).partition("=")
    drifted = f"{value}-drift"
    lab.sh(f"sed -i 's|^{name}=.*|{name}={drifted}|' {env_file}")

    # verify tells the file on disk is not what the running process started with.
    code, results = verify(lab, "SVC-004,ENV-001")
    assert code == 1 and results["SVC-004"]["status"] == "fail", results
    assert f"restart pending: changed on disk since PID {lab.main_pid()} started: {env_file}" in \
        results["SVC-004"]["reason"]

    # Crash loop: kill every start until systemd gives up. The restarts make the drift live.
    seen_drift, kills = False, 0
    pid = lab.main_pid()
    while kills < 10:
        if not seen_drift and kills > 0:
            seen_drift = server_env(lab, name) == drifted
        # In the nested lab, systemd can fail to signal a cgroup's "auxiliary" processes (EIO) after the
        # main one got the signal; whether the kill worked is what wait_main_pid_change sees.
        lab.ssh("systemctl kill -s SIGKILL gptoss-vllm", check=False)
        kills += 1
        pid = wait_main_pid_change(lab, pid)
        if pid == 0:
            break
    assert lab.sh("systemctl show -p ActiveState --value gptoss-vllm").strip() == "failed"
    assert "Start request repeated too quickly" in lab.sh("journalctl -u gptoss-vllm -n 5 -o cat --no-pager")
    assert seen_drift, "the drifted value never reached a running process"
    print(f"[must-show] start limit hit after {kills} kills; the drift was live: {seen_drift}")

    # The converge of the two roles involved (a full site.yml costs ~5 min on the busy 2-core box).
    result = lab.play("site.yml", "--tags", "nccl_env,vllm_service")
    print(f"[must-show] converge after the start limit: rc={result.rc} {result.seconds:.1f}s")
    assert result.rc == 0, result.output[-5000:]
    assert "systemd had given up on it after repeated crashes (start limit hit" in result.output
    assert "ran systemctl reset-failed" in result.output
    assert lab.sh(f"cat {env_file}") == original
    assert server_env(lab, name) == value
    assert completion(lab) == 200
    code, results = verify(lab, "SVC-001,SVC-004,ENV-001,API-003")
    assert code == 0, reasons(results.values())


def test_awkward_keys_pass_through_a_real_converge_unchanged(lab: Lab):
    for key in AWKWARD_KEYS:
        result = converge_vllm(lab, vllm_service_api_key=key)
        assert result.rc == 0, result.output[-5000:]
        assert key not in result.output
        assert server_env(lab, "VLLM_API_KEY") == key  # the server's own view
        assert completion(lab, key) == 200
        assert completion(lab) == 401 and completion(lab, key + "x") == 401
        code, results = verify(lab, "SVC-004,API-002,API-003")  # the checks read it the same way
        assert code == 0, reasons(results.values())
        assert found_on_lab(lab, key) == "", "the key is in a log or a backup"
        assert lab.sh("find /etc/gptoss -name 'vllm-secrets.env*~'") == ""
        print(f"[must-show] key {key!r}: server has it unchanged, 200 with it, 401 without, verify passes, "
              f"in no log or backup ({result.seconds:.1f}s)")

    before, pid = lab.checksums(*INPUTS), lab.main_pid()
    result = converge_vllm(lab, vllm_service_api_key=REFUSED_KEY)
    assert result.rc != 0
    assert "vllm_service_api_key refused: the key holds a single quote (')" in result.output
    assert "rule: an API key must be printable ASCII" in result.output and "nothing was changed" in result.output
    assert REFUSED_KEY not in result.output
    assert lab.checksums(*INPUTS) == before and lab.main_pid() == pid
    assert completion(lab, AWKWARD_KEYS[-1]) == 200
    print(f"[must-show] refused key: {result.seconds:.1f}s, MainPID unchanged")


def test_two_changing_converges_at_once_take_turns_and_end_sound(lab: Lab):
    """Both remove the API key (a change that restarts): one waits for the other's lock."""
    env = lab.env
    started = time.monotonic()
    runs = [subprocess.Popen([str(VENV_BIN / "ansible-playbook"), "playbooks/vllm.yml", "--tags", "vllm_service"],
                             cwd=ROOT, env={**env, "GPTOSS_CHANGE_HOLDER": who}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for who in ("converge-A", "converge-B")]
    outputs = [run.communicate(timeout=1200)[0] for run in runs]
    print(f"[must-show] two converges together: rc={[r.returncode for r in runs]} "
          f"in {time.monotonic() - started:.1f}s")
    assert [r.returncode for r in runs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    restarted = ["restarted (" in out for out in outputs]
    waited = [("s for the change lock held by converge-" in out) for out in outputs]
    assert sorted(restarted) == [False, True], outputs
    assert waited == [not r for r in restarted], "the one that did not restart must have waited for the other"
    for out in outputs:
        for line in out.splitlines():
            if "waited" in line and "change lock" in line:
                print(f"[must-show] {line.strip()}")
    assert lab.sh("cat /etc/gptoss/vllm-secrets.env") == NO_KEY_FILE
    assert completion(lab) == 200
    code, results = verify(lab, "SVC-001,SVC-003,SVC-004,API-002,API-003")
    assert code == 0, reasons(results.values())
