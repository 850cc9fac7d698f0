"""The NCCL P2P rule (module_utils/nccl_policy.py) and the module the nccl_env role runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_ansible_module

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.gptoss.host.plugins.module_utils import nccl_policy  # noqa: E402

# Shapes of `python3 -m service.host.nvidia --json` (the fields the rule reads), from real hosts:
# the lab (no NVML), the H200 (one GPU: no pairs) and what two GeForce / NVLink cards report.
NO_NVML = {"available": False, "p2p_supported_all_pairs": None, "p2p_reason": "no NVML: nvmlInit failed"}
ONE_GPU = {"available": True, "p2p_supported_all_pairs": None, "p2p_reason": "1 GPU(s): no GPU pairs"}
GEFORCE_PAIR = {"available": True, "p2p_supported_all_pairs": False,
                "p2p_reason": "P2P status GPU0-GPU1: chipset_not_supported"}
NVLINK_PAIR = {"available": True, "p2p_supported_all_pairs": True, "p2p_reason": "P2P status GPU0-GPU1: ok"}


@pytest.mark.parametrize(("policy", "report", "disabled"), [
    ("auto", NVLINK_PAIR, False),
    ("auto", GEFORCE_PAIR, True),
    ("auto", ONE_GPU, True),
    ("auto", NO_NVML, True),
    ("auto", None, True),
    ("enable", GEFORCE_PAIR, False),
    ("disable", NVLINK_PAIR, True),
])
def test_p2p_decision(policy, report, disabled):
    disable, reason = nccl_policy.p2p_decision(policy, report)
    assert disable is disabled
    assert reason  # always says why
    if policy == "auto" and report:
        assert reason == report["p2p_reason"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy 'sometimes'"):
        nccl_policy.p2p_decision("sometimes", NVLINK_PAIR)


def test_file_body_lists_sorted_variables_as_strings():
    result = nccl_policy.policy_file("auto", GEFORCE_PAIR, extra={"NCCL_DEBUG": "WARN"})
    assert result["variables"] == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN"}
    assert result["content"].splitlines() == [
        "# P2P: disabled (P2P status GPU0-GPU1: chipset_not_supported)",
        "NCCL_DEBUG=WARN", "NCCL_IB_DISABLE=1", "NCCL_P2P_DISABLE=1", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]
    on = nccl_policy.policy_file("auto", NVLINK_PAIR, ib_disable=False)
    assert on["variables"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert on["content"].startswith("# P2P: left to NCCL (P2P status GPU0-GPU1: ok)\n")


@pytest.mark.parametrize(("extra", "message"), [
    ({"nccl-debug": "WARN"}, "'nccl-debug' is not a valid environment variable name"),
    ({"NCCL_DEBUG": "WARN\nLD_PRELOAD=/tmp/x.so"}, "the value of NCCL_DEBUG has a line break"),
])
def test_bad_extra_variables_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        nccl_policy.policy_file("disable", None, extra=extra)


def run_module(args: dict) -> dict:
    """The real module through ansible (localhost, check mode): what the role gets back."""
    return run_ansible_module("nccl_policy", args, "--check")


def test_module_returns_the_rule_and_refuses_bad_input():
    ok = run_module({"policy": "auto", "nvml_report": json.dumps(NVLINK_PAIR)})
    assert ok["changed"] is False and ok["p2p_disable"] is False
    assert ok["content"] == nccl_policy.policy_file("auto", NVLINK_PAIR)["content"]
    bad = run_module({"policy": "auto", "nvml_report": "{not json"})
    assert bad["failed"] and "the NVML report is not JSON" in bad["msg"]
