"""Issue 8: faults survived, secrets kept secret (against the real lab)."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import pytest
import run_times
from conftest import Lab, kill_play_tree

from lab import nspawn

API_KEY = "lab-test-key-0123456789abcdef"


def wait_serving(lab: Lab, timeout: float = 240, headers: dict | None = None) -> float:
    """Seconds until /v1/completions answers with tokens."""
    started = time.monotonic()
    body = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}).encode()
    while time.monotonic() - started < timeout:
        request = urllib.request.Request(f"{lab.base_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if json.loads(response.read())["usage"]["completion_tokens"] == 2:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise AssertionError(f"server did not serve within {timeout}s")


def test_kill_9_of_the_main_process_is_restarted_by_systemd(lab: Lab):
    pid = lab.main_pid()
    restarts = int(lab.sh("systemctl show -p NRestarts --value gptoss-vllm").strip())
    killed_at = time.time()
    lab.sh(f"kill -9 {pid}")
    seconds = wait_serving(lab)
    assert lab.main_pid() != pid
    assert int(lab.sh("systemctl show -p NRestarts --value gptoss-vllm").strip()) == restarts + 1
    # The suite's record counts vLLM starts from each lab's journal, read on the controller (run_times):
    # this one restart, and no other, is what it reads.
    assert run_times.vllm_starts(run_times.lab_journal_dirs(nspawn.LABS_DIR, lab.name), killed_at) == 1
    print(f"serving again {seconds:.0f}s after kill -9")


def test_engine_core_killed_as_by_the_oom_killer_is_restarted_by_systemd(lab: Lab):
    """The fleet drill's failure: the kernel's OOM killer ended vLLM's engine core, the API server then
    exited on its own, and Restart=on-failure left the host down. SIGKILL to the engine core is what the OOM
    killer sends; with Restart=always the unit comes back however the server exits."""
    pid = lab.main_pid()
    restarts = int(lab.sh("systemctl show -p NRestarts --value gptoss-vllm").strip())
    children = lab.sh(f"ps --ppid {pid} -o pid=,args=")
    engine = [line.split()[0] for line in children.splitlines() if "EngineCore" in line]
    assert engine, f"no EngineCore process under the server {pid}: {children}"
    lab.sh(f"kill -9 {engine[0]}")
    seconds = wait_serving(lab)
    assert lab.main_pid() != pid
    assert int(lab.sh("systemctl show -p NRestarts --value gptoss-vllm").strip()) == restarts + 1
    exits = lab.sh("journalctl -u gptoss-vllm -o cat --since '-5min' | grep -E 'Main process exited' | tail -2 || true")
    print(f"engine core killed: serving again {seconds:.0f}s later; the server's exit: {exits.strip()}")


def test_lab_reboot_brings_everything_back_without_a_play(lab: Lab):
    nspawn.restart(lab.state.name)
    wait_serving(lab)
    assert lab.sh("systemctl is-active gptoss-vllm gptoss-cpu-governor").split() == ["active", "active"]
    mount = lab.sh("grep ' /models ' /proc/self/mountinfo")
    assert "noatime" in mount and "nobarrier" in mount
    env = lab.sh(f"tr '\\0' '\\n' < /proc/{lab.main_pid()}/environ")
    assert "NCCL_P2P_DISABLE=1" in env and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in env


@pytest.fixture(scope="module")
def keyed_server(lab: Lab):
    result = lab.play("playbooks/vllm.yml", extra_vars={"vllm_service_api_key": API_KEY, "reverse_proxy_enabled": True})
    assert result.rc == 0, result.output[-4000:]
    yield result
    restored = lab.play("playbooks/vllm.yml")
    assert restored.rc == 0, restored.output[-4000:]


def test_api_key_guards_v1_and_never_leaks(lab: Lab, keyed_server):
    assert API_KEY not in keyed_server.output  # no_log kept it out of the play output
    assert lab.sh("stat -c '%a %U %G' /etc/gptoss/vllm-secrets.env").strip() == "600 root root"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{lab.base_url}/v1/models", timeout=10)
    assert denied.value.code == 401
    wait_serving(lab, headers={"Authorization": f"Bearer {API_KEY}"})
    pid = lab.main_pid()
    assert API_KEY not in lab.sh(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert API_KEY not in lab.sh("cat /etc/systemd/system/gptoss-vllm.service")
    assert API_KEY not in lab.sh("journalctl -u gptoss-vllm --no-pager -o cat")


def test_https_completion_through_the_reverse_proxy(lab: Lab, keyed_server, tmp_path):
    cert = tmp_path / "proxy.crt"
    cert.write_text(lab.sh("cat /etc/gptoss/tls/proxy.crt"))
    context = ssl.create_default_context(cafile=str(cert))  # real verification against the lab's cert
    url = f"https://{lab.state.address}:8443/v1/completions"
    body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).encode()
    wait_serving(lab, headers={"Authorization": f"Bearer {API_KEY}"})
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 4
    anonymous = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(anonymous, timeout=30, context=context)
    assert denied.value.code == 401


def test_interrupted_play_converges_when_run_again(lab: Lab):
    import subprocess

    from conftest import ROOT, VENV_BIN

    changed_flags = {"vllm_service_flags_override": {"max-num-seqs": 3}}
    proc = subprocess.Popen([str(VENV_BIN / "ansible-playbook"), "site.yml", "-e", json.dumps(changed_flags)],
                            cwd=ROOT, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    time.sleep(40)  # somewhere in the middle of the play (it takes well over a minute)
    kill_play_tree(proc)
    rerun = lab.play("site.yml")
    assert rerun.rc == 0, rerun.output[-5000:]
    # No half-written file anywhere the play writes: atomic writes leave only whole files.
    leftovers = lab.sh("find /etc /models /opt/gptoss/lib /boot/grub -xdev \\( -name '.fstab.*' -o -name '*.tmp-*' "
                       "-o -name '.ansible_tmp*' -o -name '*.partial' \\) -print")
    assert leftovers.strip() == "", leftovers
    assert "--max-num-seqs 4" in lab.sh("systemctl show -p ExecStart --value gptoss-vllm")
    wait_serving(lab)
