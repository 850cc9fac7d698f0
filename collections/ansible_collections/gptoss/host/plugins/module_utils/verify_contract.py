"""The verify contract: what each role promises in ``verify.d/<role>.json``, the one home of its keys.

Roles write their record through the ``gptoss.host.verify_record`` module (``vllm_service`` through
``gptoss.host.vllm_change``, which writes it inside its transaction); both call ``check_record``, so a
record with a key nobody declared, a missing key or a wrong type is refused before anything is
written. ``service.host.checks`` reads every record through ``RoleRecord``, which refuses to read an
undeclared key. ``tests/test_verify_contract.py`` proves that every declared key is written by its role
and read by a check (or by the rollout gate), so the writers and the readers cannot drift apart.

Runs on the controller (the module) and on the host's system python (verify): standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NONE = type(None)


@dataclass(frozen=True)
class Key:
    types: tuple[type, ...]
    doc: str
    required: bool = True


# role -> key -> what it means and who reads it. Keep docs/design.md's table ("Host file contract")
# pointing here rather than repeating the keys.
CONTRACT: dict[str, dict[str, Key]] = {
    "nvidia_driver": {
        "require_gpu": Key((bool,), "no GPU or no NVML is a failure, not a skip (every DRV/GPU check)"),
        "min_driver": Key((str,), "the project's driver floor (DRV-001)"),
        "vllm_venv": Key((str,), "the venv whose torch/version.py decides the CUDA build (DRV-002); '' = none"),
        "build": Key((dict, NONE), "the version chain the converge derived, shown beside the installed one "
                                   "(DRV-002)"),
        "p2p_expected": Key((str,), "supported | unsupported | any (GPU-004)"),
        "gpu_count": Key((int, NONE), "GPUs NVML must see; null = at least one (GPU-001)"),
        "gpu_name_contains": Key((str, NONE), "every GPU's name contains this (GPU-001)"),
    },
    "kernel_cmdline": {
        "method": Key((str,), "grub (flags on /proc/cmdline, KRN-001) or modprobe (driver options only)"),
        "flags": Key((list,), "the kernel/module flags, 'key=value' (KRN-001, KRN-002)"),
    },
    "model_mount": {
        "mount_point": Key((str,), "where the model file system is mounted (MNT-001)"),
        "fstype": Key((str,), "its file system type (MNT-001)"),
        "options": Key((list,), "mount options the kernel must report, 'defaults' left out (MNT-001)"),
    },
    "cpu_governor": {
        "governor": Key((str,), "scaling_governor of every CPU (CPU-001)"),
    },
    "nccl_env": {
        "variables": Key((dict,), "NAME -> value in every vLLM process (ENV-001)"),
        "p2p_reason": Key((str,), "why NCCL_P2P_DISABLE is what it is, shown with ENV-001"),
    },
    "vllm_service": {
        "unit": Key((str,), "the systemd unit (SVC-001..004, ENV-001, NET-001)"),
        "max_restarts": Key((int,), "restarts tolerated before SVC-002 fails"),
        "argv": Key((list,), "the command line the main process must have (SVC-003)"),
        "base_url": Key((str,), "where the server listens (API-001..004, NET-001, the rollout gate)"),
        "served_model_name": Key((str,), "the model name /v1/models must list (API-002..004, the gate)"),
        "api_key_file": Key((str,), "root-only file with the key, '' = no key (API checks, the gate)"),
        "tool_calling": Key((bool,), "API-004 also sends a tool-definition request"),
        "inputs": Key((list,), "files the unit reads: changed since the start = restart pending (SVC-004)"),
        "stamp_file": Key((str,), "what the main process started with (SVC-004)"),
        "venv_pointer": Key((str,), "the symlink the unit runs through; its target is the current venv (SVC-005)",
                            required=False),
        "venvs_dir": Key((str,), "where the versioned venvs live, to name the one the process loaded (SVC-005)",
                         required=False),
    },
    "model_weights": {
        "model_dir": Key((str,), "the served folder, its checksums manifest checked (MDL-001)"),
    },
    "webui": {
        "base_url": Key((str,), "where Open WebUI listens (WEB-001)"),
        "secrets_file": Key((str,), "root-only file with the admin account WEB-001 signs in with"),
    },
    "router": {
        "config_file": Key((str,), "the router's configuration: the workers RTR-001 expects it to list"),
    },
    # Written by the monitoring role's tasks/gpu_exporter.yml (a record of its own: the exporter has its switch).
    "gpu_exporter": {
        "metrics_url": Key((str,), "where gptoss-gpu-exporter serves /metrics: its GPU count and NVML state "
                                   "against NVML's (MON-004)"),
    },
    "monitoring": {
        "server": Key((str,), "the inventory host whose Prometheus scrapes this one (MON-001..003 run there)"),
        "prometheus_url": Key((str,), "Prometheus's base URL on this host, '' where another host's scrapes it "
                                      "(MON-001, MON-002)"),
        "expected_targets": Key((list,), "'<job> <instance>' of every target that must be up (MON-001)"),
        "rule_files": Key((list,), "the rule files Prometheus must have loaded (MON-002)"),
        "inputs": Key((list,), "configuration files the services read: newer than the last reload = reload "
                               "pending (MON-002)"),
        "alertmanager_url": Key((str,), "Alertmanager's base URL, '' = none (MON-003)"),
        "alertmanager_config_file": Key((str,), "the file Alertmanager must be running: its exported "
                                                "alertmanager_config_hash equals this file's (MON-003)"),
        "receivers": Key((list,), "the receiver integrations Alertmanager must have: webhook URLs, 'email <to>' "
                                  "(MON-003)"),
    },
}
# A replica instance's record, verify.d/vllm_service@<name>.json, keeps the contract of vllm_service.
INSTANCE_SEPARATOR = "@"


def contract_role(record_name: str) -> str:
    """The role whose contract a record file keeps: 'vllm_service@0' -> 'vllm_service'."""
    return record_name.split(INSTANCE_SEPARATOR, 1)[0]

# Keys that gptoss.host.vllm_change adds to the record it is given (it knows them, the role does not).
VLLM_CHANGE_ADDED_KEYS = ("inputs", "stamp_file", "venv_pointer", "venvs_dir")


class ContractError(ValueError):
    """A record (or a read) that the contract does not allow."""


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is NONE else t.__name__ for t in types)


def check_record(role: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """The record as a plain dict when it keeps the role's contract; ContractError naming every problem."""
    if contract_role(role) not in CONTRACT:
        raise ContractError(f"verify record of unknown role {role!r} (known: {', '.join(sorted(CONTRACT))})")
    keys = CONTRACT[contract_role(role)]
    problems = [f"unknown key {k!r}" for k in record if k not in keys]
    problems += [f"missing key {k!r}" for k, spec in keys.items() if spec.required and k not in record]
    for name, value in record.items():
        spec = keys.get(name)
        # bool is an int in Python: an int key must not accept true/false.
        if spec and (not isinstance(value, spec.types) or (isinstance(value, bool) and bool not in spec.types)):
            problems.append(f"{name!r} must be {_type_names(spec.types)}, got {type(value).__name__}")
    if problems:
        raise ContractError(f"verify record of {role}: " + "; ".join(problems))
    return dict(record)


def render(record: Mapping[str, Any]) -> str:
    """The file's exact text: sorted keys, so an unchanged record is an unchanged file."""
    return json.dumps(dict(record), indent=2, sort_keys=True) + "\n"


def record_path(config_dir: str | Path, role: str) -> Path:
    return Path(config_dir) / f"{role}.json"


class RoleRecord(Mapping[str, Any]):
    """A role's record as the checks see it: reading a key outside the contract is a bug, said loudly."""

    def __init__(self, role: str, data: Mapping[str, Any]):
        self.role = role
        self._data = dict(data)

    def _declared(self, key: str) -> None:
        if key not in CONTRACT.get(contract_role(self.role), {}):
            raise ContractError(f"{self.role}: key {key!r} is not in the verify contract")

    def __getitem__(self, key: str) -> Any:
        self._declared(key)
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._declared(key)
        return self._data.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)
