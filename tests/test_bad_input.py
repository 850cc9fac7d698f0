"""Issue 8: every bad input stops early with a clear message naming it, and nothing on the host changes."""

from __future__ import annotations

import pytest
from conftest import WATCHED_PATHS, Lab

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
    "kernel flag with a shell": ("playbooks/host.yml", {"kernel_cmdline_flags": ["nvidia.NVreg_X=1; reboot"]},
                                 "is not a single key=value"),
    "P2P policy unknown": ("playbooks/host.yml", {"nccl_env_p2p": "sometimes"}, "nccl_env_p2p"),
    "NCCL variable name": ("playbooks/host.yml", {"nccl_env_extra": {"nccl-debug": "WARN"}},
                           "nccl_env_extra: 'nccl-debug' is not a valid environment variable name"),
    "governor unknown": ("playbooks/host.yml", {"cpu_governor_governor": "turbo"}, "cpu_governor_governor"),
    "off loopback, no key": ("playbooks/vllm.yml", {"vllm_service_host": "0.0.0.0"},
                             "is not loopback: set vllm_service_api_key"),
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
