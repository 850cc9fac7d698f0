"""Issue 5: the tuned vLLM service in the lab: real systemd, real vLLM, safe rollout."""

from __future__ import annotations

import json
import re
import urllib.request

from conftest import Lab, record_timing

UNIT = "/etc/systemd/system/gptoss-vllm.service"


def http_json(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_unit_is_active_and_serves_the_model(lab: Lab, converged):
    status = lab.ssh("systemctl status gptoss-vllm --no-pager", check=False).stdout
    assert "Active: active (running)" in status
    assert "vllm.entrypoints.openai.api_server" in lab.sh(f"ps -o args= -p {lab.main_pid()}")
    models = http_json(f"{lab.base_url}/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    completion = http_json(f"{lab.base_url}/v1/completions",
                           {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8})
    assert completion["usage"]["completion_tokens"] == 8
    # The YAML callback folds long messages over several lines.
    # gptoss.host.vllm_change reports the health gate's JSON as "gate: {...}".
    # The report names the unit it rolled ("gptoss-vllm.service: restarted (...) ... gate: {...}").
    rollout = re.search(r"gptoss-vllm\S*\.service: restarted .*?gate: (\{.*?\})", converged.first.output, re.DOTALL)
    assert rollout, "no rollout report in the converge output"
    timing = json.loads(re.sub(r"\s*\n\s*", " ", rollout.group(1)))
    assert timing["ok"] is True
    record_timing("unit_start_to_first_completion", timing["first_completion_after_s"])


def test_unit_is_hardened_and_runs_unprivileged(lab: Lab):
    unit = lab.sh(f"cat {UNIT}")
    for setting in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                    "ReadWritePaths=/var/cache/gptoss", "DeviceAllow=char-nvidia-frontend rw",
                    "Restart=always", "EnvironmentFile=/etc/gptoss/vllm-secrets.env"):
        assert setting in unit, setting
    assert "--api-key" not in unit
    pid = lab.main_pid()
    assert lab.sh(f"ps -o user= -p {pid}").strip() == "gptoss"
    assert lab.sh("stat -c '%a %U' /etc/gptoss/vllm-secrets.env").strip() == "600 root"
    score = lab.sh("systemd-analyze security gptoss-vllm.service --no-pager | tail -1")
    print(score)
    exposure = float(re.search(r"level for gptoss-vllm.service: ([0-9.]+)", score).group(1))
    assert exposure <= 4.0


def test_bad_flag_stops_before_the_unit_and_the_server_keeps_serving(lab: Lab):
    before_unit = lab.checksums(UNIT, "/etc/gptoss/vllm-args.json")
    pid = lab.main_pid()
    result = lab.play("playbooks/vllm.yml", extra_vars={"vllm_service_flags_override": {"kv-cache-dtype": "fp16"}})
    assert result.rc != 0
    assert "--kv-cache-dtype" in result.output and "fp16" in result.output and "float16" in result.output
    assert lab.checksums(UNIT, "/etc/gptoss/vllm-args.json") == before_unit
    assert lab.main_pid() == pid
    completion = http_json(f"{lab.base_url}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4})
    assert completion["usage"]["completion_tokens"] == 4


def test_change_that_fails_at_start_is_rolled_back(lab: Lab):
    """Valid inputs, but the server cannot start with them: every input and the verify record go back,
    and the previous configuration serves again (issue 14: a forced failure late in the rollout)."""
    inputs = [UNIT, "/etc/gptoss/vllm-args.json", "/etc/gptoss/vllm-secrets.env",
              "/etc/gptoss/verify.d/vllm_service.json", "/etc/gptoss/nccl.env", "/var/lib/gptoss/vllm-started.json"]
    before, pid = lab.checksums(*inputs), lab.main_pid()
    backups_before = lab.sh("find /etc/gptoss /etc/systemd/system -name '*~' | sort")
    key = "late-failure-key-0123456789"
    # Unit (env), args (a flag) and secrets (a key) change together; 100 TB of KV cache passes flag
    # validation but cannot be allocated at start, so the failure comes after every write and the restart.
    result = lab.play("playbooks/vllm.yml", "--tags", "vllm_service", extra_vars={
        "vllm_service_env_override": {"VLLM_CPU_KVCACHE_SPACE": "100000"},
        "vllm_service_flags_override": {"max-num-seqs": 3}, "vllm_service_api_key": key})
    print(f"failed change + undo: rc={result.rc} in {result.seconds:.1f}s")
    assert result.rc != 0
    assert "the new configuration did not serve" in result.output, result.output[-5000:]
    assert "Restored 4 input(s) to their previous content" in result.output, result.output[-5000:]
    assert f"serving again on {lab.base_url}: yes" in result.output, result.output[-5000:]
    assert lab.checksums(*inputs) == before
    assert lab.main_pid() != pid  # the previous configuration was restarted, not left dead
    # No backup holds the key, and the failed change left no new backup behind.
    assert lab.sh("find /etc/gptoss /etc/systemd/system -name '*~' | sort") == backups_before
    assert key not in lab.sh("cat /etc/gptoss/*~ /etc/systemd/system/*~ 2>/dev/null; true")
    assert key not in result.output
    completion = http_json(f"{lab.base_url}/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4})
    assert completion["usage"]["completion_tokens"] == 4
