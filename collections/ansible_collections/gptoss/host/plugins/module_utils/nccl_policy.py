"""The NCCL environment of gptoss-vllm.service: the P2P decision and the file's content.

One home for the rule, used by the `gptoss.host.nccl_policy` module (the nccl_env role writes what
it returns) and by bench/nccl_allreduce.py (which runs the all-reduce under the very file the role
would write for each policy). Standard library only: it runs in Ansible modules on the host.
"""

from __future__ import annotations

import re
from typing import Any

POLICIES = ("auto", "enable", "disable")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def p2p_decision(policy: str, nvml_report: dict[str, Any] | None) -> tuple[bool, str]:
    """(disable P2P?, why) for a policy and the host's `service.host.nvidia --json` report.

    `auto` keeps P2P only when NVML says every GPU pair can do it: GeForce cards such as the 4090D
    report no P2P, and NCCL's own probe then tries a path that hangs or corrupts on some boards.
    No NVML answer at all means "disable", because a wrong "on" hangs, a wrong "off" only costs speed.
    """
    if policy not in POLICIES:
        raise ValueError(f"nccl_env_p2p: unknown policy {policy!r} (use one of {', '.join(POLICIES)})")
    if policy != "auto":
        return policy == "disable", f"nccl_env_p2p={policy}"
    if not nvml_report:
        return True, "no NVML answer: disabled to be safe"
    reason = str(nvml_report.get("p2p_reason") or "no P2P report")
    return nvml_report.get("p2p_supported_all_pairs") is not True, reason


def env_variables(p2p_disable: bool, ib_disable: bool, torch_async_error_handling: int | str,
                  extra: dict[str, Any] | None = None) -> dict[str, str]:
    """The variables as strings, the way a process environment holds them (verify compares those)."""
    variables: dict[str, str] = {}
    if p2p_disable:
        variables["NCCL_P2P_DISABLE"] = "1"
    if ib_disable:
        variables["NCCL_IB_DISABLE"] = "1"
    variables["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = str(torch_async_error_handling)
    for name, value in (extra or {}).items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"nccl_env_extra: {name!r} is not a valid environment variable name")
        if "\n" in str(value):
            raise ValueError(f"nccl_env_extra: the value of {name} has a line break")
        variables[name] = str(value)
    return variables


def render_env_file(variables: dict[str, str], p2p_disable: bool, reason: str) -> str:
    """The EnvironmentFile body (the role adds only its 'managed by Ansible' line above it)."""
    lines = [f"# P2P: {'disabled' if p2p_disable else 'left to NCCL'} ({reason.strip()})"]
    lines += [f"{name}={variables[name]}" for name in sorted(variables)]
    return "\n".join(lines) + "\n"


def policy_file(policy: str, nvml_report: dict[str, Any] | None, ib_disable: bool = True,
                torch_async_error_handling: int | str = 1, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the role needs for one policy: variables, decision, reason and the file body."""
    disable, reason = p2p_decision(policy, nvml_report)
    variables = env_variables(disable, ib_disable, torch_async_error_handling, extra)
    return {"p2p_disable": disable, "reason": reason, "variables": variables,
            "content": render_env_file(variables, disable, reason)}
