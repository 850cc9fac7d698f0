"""``python3 -m service.host.preflight``: what a converge would need on this host, and whether it can work.

Read-only: it reads /etc/os-release, sysfs, /proc, NVML (optional), statvfs and the model's files, and
writes nothing. ``playbooks/preflight.yml`` runs it on each host with an input JSON built from the
roles' own defaults and the inventory (``--input FILE``), and ``invoke preflight`` prints the result.

Each item has a status:
  ok           nothing to do
  will-change  the converge will do it and the configuration allows it
  blocked      the host needs something the configuration does not allow (the fix is named)
  unknown      could not be decided (the reason says what is missing)
  skip         not evaluated (role disabled, no GPU, ...)

Usage: `check [--input FILE] [--json]` (this host), `model-info DIR` (a model folder as JSON),
`required-driver --cuda X.Y [--floor N]` (the minimum driver as JSON).
Exit codes of check: 0 no item blocked, 1 an item is blocked, 2 the input could not be read.
The rules (memory fit, driver decision, space) are plain functions with unit tests
(tests/test_preflight.py); the host readers reuse service.host.checks and service.host.nvidia.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ansible_collections.gptoss.host.plugins.module_utils import (
    kernel_flags,
    monitoring_config,
    mountinfo,
    version_chain,
)

from service.host import nvidia
from service.host.report import PREFLIGHT_COLUMNS, ReportRow

STATUSES = ("ok", "will-change", "blocked", "unknown", "skip")
NVIDIA_PCI_VENDOR = "0x10de"
GIB = 1024 ** 3
# Bytes per element of the dtype names config.json and vLLM's --dtype/--kv-cache-dtype use.
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def Item(id: str, title: str, status: str, found: str = "", need: str = "", fix: str = "") -> ReportRow:
    """A preflight item is a report row (service/host/report.py, the type verify's checks return), built
    in preflight's own words: what was found, what is needed (the row's `expected`) and the fix (its
    `reason`); the JSON keeps them as found/need/fix."""
    return ReportRow(id, title, status, expected=need, found=found, reason=fix)


# ------------------------------------------------------------------ small rules


def python_satisfies(version: str, requires: str) -> bool:
    """'3.11.2' against a Requires-Python specifier set such as '>=3.10,<3.14' (PEP 440 subset:
    ==, !=, >=, <=, >, <, ~= and trailing .* on == / !=, numeric release parts only)."""
    have = version_chain.version_tuple(version)
    for clause in (c.strip() for c in requires.split(",") if c.strip()):
        match = re.fullmatch(r"(~=|==|!=|>=|<=|>|<)\s*([0-9]+(?:\.[0-9]+)*)(\.\*)?", clause)
        if not match:
            raise ValueError(f"Requires-Python clause {clause!r} is not understood")
        op, text, wildcard = match.groups()
        want = version_chain.version_tuple(text)
        pad = max(len(want), len(have))
        have_p, want_p = have + (0,) * (pad - len(have)), want + (0,) * (pad - len(want))
        if wildcard or op == "~=":
            prefix = want if wildcard else want[:-1]
            same = have[:len(prefix)] == prefix
            ok = (same if op == "==" else not same) if wildcard else (same and have_p >= want_p)
        else:
            ok = {"==": have_p == want_p, "!=": have_p != want_p, ">=": have_p >= want_p,
                  "<=": have_p <= want_p, ">": have_p > want_p, "<": have_p < want_p}[op]
        if not ok:
            return False
    return True


def human_bytes(value: float) -> str:
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 1024 ** 2:.1f} MiB"


# ------------------------------------------------------------------ memory fit (vLLM's own rules)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def model_dtype_bytes(config: dict[str, Any], dtype_flag: str | None) -> int:
    """Bytes per element vLLM computes in for this model.

    --dtype wins when it is not 'auto'. With 'auto' vLLM takes the config's torch_dtype (transformers 5:
    'dtype'), and a float32 or missing one is served in the platform's 16-bit type on a GPU
    (vllm/config/model.py _resolve_auto_dtype): 2 bytes.
    """
    if dtype_flag and str(dtype_flag).lower() != "auto":
        return DTYPE_BYTES[str(dtype_flag).lower()]
    configured = str(config.get("torch_dtype") or config.get("dtype") or "float32").lower()
    return 2 if configured in ("float32", "float") else DTYPE_BYTES.get(configured, 2)


def kv_cache_need(config: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """KV cache bytes per GPU that vLLM requires for ONE request of max-model-len before it starts.

    Mirrors vLLM 0.32's start-up check (vllm/v1/kv_cache_interface.py max_memory_usage_bytes):
    - page = block_size x kv_heads_per_rank x (K + V head_dim) x dtype bytes, per layer;
    - a full-attention layer holds cdiv(max_model_len, block) pages;
    - a sliding-window layer holds cdiv(min(window - 1 + in_flight, max_model_len), block) + 1 pages,
      where in_flight = max_num_batched_tokens x concurrent batches (2 with --async-scheduling).
    Tensor parallelism divides the KV heads (at least one head per rank).
    """
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    tp = int(flags.get("tensor-parallel-size") or 1)
    max_model_len = int(flags.get("max-model-len") or config.get("max_position_embeddings") or 0)
    if max_model_len <= 0:
        raise ValueError("no max-model-len in the profile and no max_position_embeddings in config.json")
    block = int(flags.get("block-size") or 16)
    kv_dtype = str(flags.get("kv-cache-dtype") or "auto").lower()
    dtype_bytes = (model_dtype_bytes(config, flags.get("dtype")) if kv_dtype == "auto"
                   else DTYPE_BYTES[kv_dtype])
    # Without chunked prefill one step must hold a whole prompt: max_num_batched_tokens >= max_model_len.
    batched = int(flags.get("max-num-batched-tokens") or max_model_len)
    in_flight = batched * (2 if flags.get("async-scheduling") else 1)
    window = config.get("sliding_window")
    types = config.get("layer_types") or (["sliding_attention"] * layers if window else ["full_attention"] * layers)
    if len(types) != layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    heads_per_rank = max(1, kv_heads // tp)
    page = block * heads_per_rank * 2 * head_dim * dtype_bytes
    full = sum(1 for t in types if t != "sliding_attention")
    sliding = layers - full
    full_pages = _cdiv(max_model_len, block)
    sliding_pages = _cdiv(min(int(window or 0) - 1 + in_flight, max_model_len), block) + 1 if sliding else 0
    total = page * (full * full_pages + sliding * sliding_pages)
    return {"bytes": total, "max_model_len": max_model_len, "full_layers": full, "sliding_layers": sliding,
            "sliding_window": window, "kv_heads_per_gpu": heads_per_rank, "head_dim": head_dim,
            "dtype_bytes": dtype_bytes, "block_size": block, "tensor_parallel": tp,
            "bytes_per_token_full_layers": full * heads_per_rank * 2 * head_dim * dtype_bytes}


def memory_fit(model: dict[str, Any] | None, flags: dict[str, Any], gpu_memory: list[int] | None) -> ReportRow:
    """Weights / TP plus the KV cache of one max-model-len request, against each GPU at its
    gpu-memory-utilization. Activations and CUDA graphs come on top (vLLM measures them at start)."""
    iid, title = "MEM", "Profile memory fit (weights + KV cache per GPU)"
    if not model or not model.get("config"):
        reason = (model or {}).get("reason") or "model not present"
        return Item(iid, title, "unknown", "", "", f"unknown: {reason}")
    try:
        kv = kv_cache_need(model["config"], flags)
    except (KeyError, ValueError, TypeError) as err:
        return Item(iid, title, "unknown", "", "", f"config.json of {model.get('where', '?')}: {err}")
    tp = kv["tensor_parallel"]
    weights = int(model.get("weight_bytes") or 0)
    need = weights // tp + kv["bytes"]
    util = float(flags.get("gpu-memory-utilization") or 0.9)
    need_text = (f"{human_bytes(need)} per GPU = weights {human_bytes(weights)}/TP{tp} + KV "
                 f"{human_bytes(kv['bytes'])} for max-model-len {kv['max_model_len']} "
                 f"({kv['full_layers']} full + {kv['sliding_layers']} sliding-window layers, "
                 f"{kv['kv_heads_per_gpu']} KV heads x {kv['head_dim']} x {kv['dtype_bytes']} B)")
    if not weights:
        need_text += "; weight size unknown (no weight files)"
    if gpu_memory is None:
        return Item(iid, title, "skip", "", need_text, "not evaluated: no GPU")
    if not gpu_memory:
        return Item(iid, title, "skip", "", need_text, "not evaluated: no GPU")
    used = tp * int(flags.get("data-parallel-size") or 1)
    if used > len(gpu_memory):
        return Item(iid, title, "blocked", f"{len(gpu_memory)} GPU(s)", need_text,
                    f"the profile needs {used} GPUs (TP x DP), the host has {len(gpu_memory)}")
    budgets = [int(total * util) for total in gpu_memory[:used]]
    found = ", ".join(f"GPU{i}: {human_bytes(b)} ({util:g} x {human_bytes(t)})"
                      for i, (b, t) in enumerate(zip(budgets, gpu_memory[:used], strict=True)))
    short = [i for i, b in enumerate(budgets) if b < need]
    if short:
        return Item(iid, title, "blocked", found, need_text,
                    f"GPU{short[0]} is {human_bytes(need - budgets[short[0]])} short: lower max-model-len, raise "
                    "gpu-memory-utilization or tensor-parallel-size (vllm_service_flags_override)")
    spare = min(budgets) - need
    return Item(iid, title, "ok", found, need_text,
                f"{human_bytes(spare)} left per GPU for activations and more concurrent requests")


# ------------------------------------------------------------------ driver decision


def _offer_text(package: dict[str, Any]) -> str:
    """One package of gptoss.host.apt_candidate's answer in words."""
    if not package.get("candidate"):
        return f"{package.get('name')}: no configured source offers it"
    text = (f"{package['name']} {package['candidate']} from "
            f"{', '.join(package.get('candidate_sources') or []) or 'an installed package'}")
    if not package.get("candidate_meets") and package.get("best_offer"):
        text += f" (pinned below {package['best_offer']} from {', '.join(package.get('best_offer_sources') or [])})"
    return text


def driver_plan(*, running: str | None, required: str | None, required_why: str, apt: dict[str, Any] | None,
                install: bool, reboot_ok: bool, evaluate: bool, apt_reason: str = "",
                fix: str = "", repo_pending: str = "", cpu_build: bool = False) -> tuple[ReportRow, bool]:
    """Running driver vs the derived minimum, and what apt would install from the configured sources.

    `apt` is the answer of the gptoss.host.apt_candidate module (read-only: no refresh) for the
    packages that carry the driver's version: its `ok` is the one rule "every candidate reaches the
    requirement" that the role applies before installing. Returns the item and whether a reboot will
    be needed. `evaluate` is False on a host without a GPU where none is required (the role installs
    nothing there); the plan is shown all the same. `repo_pending` names NVIDIA's repository when the
    converge would add it first: apt cannot say what it offers before, so that is "unknown", not "blocked".
    """
    iid, title = "DRV", "Driver: running vs required, apt candidate per source"
    if cpu_build:
        return Item(iid, title, "skip", f"running {running or 'none'}", required_why,
                    "a CPU build of vLLM needs no NVIDIA driver"), False
    if apt is not None:
        offers = "; ".join(_offer_text(p) for p in apt.get("packages", [])) or "no packages"
        offers += "".join(f"; {u['url']} not readable: {u['reason']}" for u in apt.get("unreadable_sources", []))
    else:
        offers = f"unknown ({apt_reason or 'not read'})"
    found = f"running {running or 'none'}; candidates: {offers}"
    need = f">= {required} ({required_why})" if required else f"unknown ({required_why})"
    if not required:
        return Item(iid, title, "unknown", found, need, "the minimum driver could not be derived"), False
    if running and version_chain.version_tuple(running) >= version_chain.version_tuple(required):
        return Item(iid, title, "ok", found, need), False
    can_install = apt is not None and bool(apt.get("ok"))
    if not evaluate:
        return Item(iid, title, "skip", found, need,
                    "no GPU and none required (nvidia_driver_require_gpu: false): the role installs nothing"
                    + ("" if can_install else "; on a GPU host no configured source would have it")), False
    if not install:
        return Item(iid, title, "blocked", found, need,
                    f"driver {running or 'none'} is below {required} and nvidia_driver_install is false"), False
    if apt is None:
        return Item(iid, title, "unknown", found, need, "what apt would install is not known"), False
    if not can_install and repo_pending:
        return Item(iid, title, "unknown", found, need,
                    f"the converge adds {repo_pending} first and reads its candidate then, refusing before it "
                    f"installs anything when it has no driver >= {required}; check that this host can reach it"), False
    if not can_install:
        return Item(iid, title, "blocked", found, need,
                    f"no configured source offers a driver >= {required} for every driver package"
                    + (f"; {fix}" if fix else "")), False
    action = "install " + ", ".join(f"{p['name']} {p['candidate']}" for p in apt.get("packages", []))
    if reboot_ok:
        return Item(iid, title, "will-change", found, need, f"{action}, then reboot (nvidia_driver_reboot_ok)"), True
    return Item(iid, title, "blocked", found, need,
                f"{action}; the new module needs a reboot before vLLM can start and nvidia_driver_reboot_ok is "
                "false: set it, or reboot by hand after the converge"), True


def required_driver(cfg: dict[str, Any]) -> tuple[str | None, str]:
    """The minimum driver and why: an explicit `required` (derived from the vLLM build by the caller),
    else NVIDIA's table for nvidia_driver_cuda_version (service.host.nvidia, as detect.yml uses it), never
    below nvidia_driver_floor."""
    floor = str(cfg.get("floor") or nvidia.PROJECT_DRIVER_FLOOR)
    if cfg.get("required"):
        required, why = str(cfg["required"]), str(cfg.get("required_why") or "derived from the vLLM build")
    else:
        cuda = str(cfg.get("cuda_version") or "")
        if not cuda or cuda == "auto":
            # The caller's reason (the version chain's own words) when it could not derive the build.
            return None, str(cfg.get("required_why") or
                             "nvidia_driver_cuda_version is auto and the vLLM build's CUDA version was not derived")
        try:
            required, why = version_chain.minimum_driver_for_cuda(cuda), f"CUDA {cuda}, nvidia_driver_cuda_version"
        except ValueError as err:
            return None, str(err)
    if version_chain.version_tuple(floor) > version_chain.version_tuple(required):
        return floor, f"nvidia_driver_floor {floor}"
    return required, why


# ------------------------------------------------------------------ host readers


def read_os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    info = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            info[key.strip()] = value.strip().strip('"')
    return info


def pci_nvidia_devices(root: Path = Path("/sys/bus/pci/devices")) -> list[dict[str, str]]:
    """NVIDIA display/3D controllers from sysfs: visible before any driver is loaded."""
    devices = []
    for dev in sorted(root.glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and klass.startswith("0x03"):
            driver = dev / "driver"
            devices.append({"address": dev.name, "device": (dev / "device").read_text().strip(),
                            "driver": driver.resolve().name if driver.exists() else ""})
    return devices


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(nearest_existing(path)).free


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    return files or sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def model_info(model_dir: Path) -> dict[str, Any]:
    """config.json and weight bytes of a model folder; {'reason'} when it is not there."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return {"where": str(model_dir), "reason": f"model not present ({config_path} missing)"}
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return {"where": str(model_dir), "reason": f"{config_path}: {err}"}
    files = weight_files(model_dir)
    return {"where": str(model_dir), "config": config, "weight_bytes": sum(p.stat().st_size for p in files),
            "weight_files": len(files)}


def block_device_size(device: str) -> tuple[Path | None, int | None]:
    """UUID=/LABEL=/PARTUUID= or a path -> (resolved device, size in bytes from sysfs)."""
    for prefix, folder in (("UUID=", "by-uuid"), ("LABEL=", "by-label"), ("PARTUUID=", "by-partuuid")):
        if device.startswith(prefix):
            device = f"/dev/disk/{folder}/{device[len(prefix):]}"
    path = Path(device)
    if not path.exists():
        return None, None
    real = path.resolve()
    try:
        sectors = int((Path("/sys/class/block") / real.name / "size").read_text())
    except (OSError, ValueError):
        return real, None
    return real, sectors * 512


def probe_fstype(device: Path) -> str:
    """The file system on an unmounted device, by blkid's low-level probe (-p reads the device only,
    it neither uses nor writes the blkid cache)."""
    exe = shutil.which("blkid")
    if exe is None:
        return ""
    proc = subprocess.run([exe, "-p", "-o", "value", "-s", "TYPE", str(device)], capture_output=True, text=True,
                          timeout=10, check=False)
    return proc.stdout.strip()


def system_python_version(python: str) -> tuple[str | None, str]:
    try:
        proc = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, timeout=20, check=False)
    except OSError as err:
        return None, f"{python}: {err.strerror or err}"
    if proc.returncode != 0:
        return None, f"{python} failed: {proc.stderr.strip()[:200]}"
    return proc.stdout.strip(), python


# ------------------------------------------------------------------ the items


def os_item(os_release: dict[str, str]) -> ReportRow:
    found = f"{os_release.get('PRETTY_NAME', '?')} (kernel {platform.release()})"
    distro = os_release.get("ID", "")
    if distro == "debian" and os_release.get("VERSION_ID") in ("12", "13"):
        return Item("OS", "Operating system", "ok", found)
    if distro == "ubuntu" and os_release.get("VERSION_ID") in ("22.04", "24.04"):
        return Item("OS", "Operating system", "ok", found, "", "Ubuntu: package names kept, untested")
    return Item("OS", "Operating system", "unknown", found, "Debian 12/13 (tested), Ubuntu 22.04/24.04",
                "not a release this project knows how to provision")


def gpu_item(pci: list[dict[str, str]], nvml: dict[str, Any], require_gpu: bool) -> ReportRow:
    pci_text = f"PCI: {len(pci)} NVIDIA ({', '.join(d['address'] + ' ' + d['device'] for d in pci) or 'none'})"
    if nvml.get("available"):
        nvml_text = "NVML: " + (", ".join(f"{g['name']} {human_bytes(g['memory_total_bytes'])}"
                                          for g in nvml["gpus"] if isinstance(g.get("memory_total_bytes"), int))
                                or "0 GPUs")
    else:
        nvml_text = f"NVML: unavailable ({nvml.get('reason')})"
    found = f"{pci_text}; {nvml_text}"
    if pci or nvml.get("gpus"):
        return Item("GPU", "GPUs (PCI and NVML)", "ok", found)
    if require_gpu:
        return Item("GPU", "GPUs (PCI and NVML)", "blocked", found, ">= 1 NVIDIA GPU",
                    "no NVIDIA GPU: set nvidia_driver_require_gpu: false for a host without one")
    return Item("GPU", "GPUs (PCI and NVML)", "skip", found, "", "no GPU (nvidia_driver_require_gpu: false)")


def kernel_flags_item(cfg: dict[str, Any], cmdline: str, proc_driver: dict[str, Any]) -> tuple[ReportRow, bool]:
    iid, title = "KRN", "Kernel/driver flags pending"
    if not cfg.get("enabled", True):
        return Item(iid, title, "skip", "", "", "kernel_cmdline_enabled: false"), False
    flags = [str(f) for f in cfg.get("flags", [])]
    method = cfg.get("method", "grub")
    params = proc_driver.get("params") if proc_driver.get("loaded") else None
    pending = list(kernel_flags.flag_problems(method, flags, cmdline, params))
    where = kernel_flags.where_read(method, params)
    need = " ".join(flags) or "no flags"
    if not pending:
        return Item(iid, title, "ok", f"all live ({where})", need), False
    note = "reboot by the play (kernel_cmdline_reboot_ok)" if cfg.get("reboot_ok") else \
        "REBOOT REQUIRED after the converge (kernel_cmdline_reboot_ok: false); the service runs without them"
    return Item(iid, title, "will-change", f"pending: {' '.join(pending)} (not in {where})", need, note), True


def model_disk_item(mount_cfg: dict[str, Any], model_dir: str, model_bytes: int | None, present_bytes: int,
                    mountinfo_text: str) -> ReportRow:
    iid, title = "DISK", "Model disk: fstype, free space vs model size"
    need_bytes = max(0, (model_bytes or 0) - present_bytes)
    need = (f"{human_bytes(need_bytes)} free for the model ({human_bytes(model_bytes)} total, "
            f"{human_bytes(present_bytes)} already in {model_dir})" if model_bytes is not None
            else "model size unknown")
    if not mount_cfg.get("enabled", True):
        free = free_bytes(Path(model_dir))
        status = "ok" if model_bytes is None or free >= need_bytes else "blocked"
        return Item(iid, title, status, f"model_mount disabled; {human_bytes(free)} free at "
                    f"{nearest_existing(Path(model_dir))}", need,
                    "" if status == "ok" else "free space on the model folder's file system")
    point = str(mount_cfg.get("path", "/models")).rstrip("/") or "/"
    want_fstype = mount_cfg.get("fstype")
    mount = mountinfo.mount_at(mountinfo_text, point)
    if mount is not None:
        free = shutil.disk_usage(point).free
        found = f"{mount['source']} on {point}: {mount['fstype']}, {human_bytes(free)} free"
        if want_fstype and mount["fstype"] != want_fstype:
            return Item(iid, title, "blocked", found, need,
                        f"model_mount_fstype is {want_fstype} but {point} is {mount['fstype']}")
        if model_bytes is not None and free < need_bytes:
            return Item(iid, title, "blocked", found, need, f"{human_bytes(need_bytes - free)} short on {point}")
        return Item(iid, title, "ok", found, need)
    device = str(mount_cfg.get("device") or "")
    if not device:
        return Item(iid, title, "blocked", f"{point} not mounted", need,
                    "model_mount_device is empty: set it to the model disk")
    real, size = block_device_size(device)
    if real is None:
        return Item(iid, title, "blocked", f"{point} not mounted; {device} not found", need,
                    f"model_mount_device {device} does not exist on this host")
    fstype = probe_fstype(real)
    found = f"{point} not mounted; {device} -> {real}: {fstype or 'no file system found'}, " \
            f"{human_bytes(size) if size else 'size ?'} (free space known once mounted)"
    if fstype and want_fstype and fstype != want_fstype:
        return Item(iid, title, "blocked", found, need, f"model_mount_fstype is {want_fstype}, {real} holds {fstype}")
    if not fstype:
        return Item(iid, title, "blocked", found, need, f"{real} has no file system: mkfs.{want_fstype} it first")
    if size is not None and model_bytes is not None and size < need_bytes:
        return Item(iid, title, "blocked", found, need, f"{real} is smaller than the model")
    return Item(iid, title, "will-change", found, need, f"model_mount will mount it on {point}")


def venv_item(cfg: dict[str, Any]) -> ReportRow:
    iid, title = "VENV", "Free space for the vLLM venv"
    if not cfg.get("enabled", True):
        return Item(iid, title, "skip", "", "", "vllm_service_enabled: false")
    venv, package = Path(cfg.get("venv") or "/opt/gptoss/venv"), str(cfg.get("package") or "vllm")
    installed = version_chain.installed_version(str(venv), package) if venv.is_dir() else None
    if installed is not None and installed == cfg.get("version"):
        return Item(iid, title, "ok", f"{package} {installed} already in {venv}", "nothing to install")
    minimum = int(cfg.get("min_free_bytes") or 0)
    free = free_bytes(venv)
    found = (f"{human_bytes(free)} free at {nearest_existing(venv)}"
             + (f"; {package} {installed} installed" if installed else ""))
    need = f">= {human_bytes(minimum)} (vllm_service_venv_min_free_gib)"
    if free < minimum:
        return Item(iid, title, "blocked", found, need, f"{human_bytes(minimum - free)} short for the venv")
    return Item(iid, title, "will-change", found, need,
                f"pip installs {package}=={cfg.get('version')} into {venv}")


def python_item(cfg: dict[str, Any]) -> ReportRow:
    iid, title = "PY", "Python for the venv vs the vLLM wheel's Requires-Python"
    version, where = system_python_version(str(cfg.get("system_python") or sys.executable))
    requires = cfg.get("requires_python")
    if version is None:
        return Item(iid, title, "blocked", where, requires or "", "the venv's system python does not run")
    found = f"{version} ({where})"
    if not requires:
        return Item(iid, title, "unknown", found, "Requires-Python unknown",
                    "the vLLM wheel's Requires-Python was not read from the configured source")
    try:
        ok = python_satisfies(version, requires)
    except ValueError as err:
        return Item(iid, title, "unknown", found, requires, str(err))
    return Item(iid, title, "ok" if ok else "blocked", found, requires,
                "" if ok else f"python {version} is outside {requires}: use a release whose python fits")


def dir_bytes(path: Path) -> int:
    """Bytes of the files below `path` (0 where it does not exist yet)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def tsdb_item(cfg: dict[str, Any]) -> ReportRow:
    """Prometheus's TSDB grows to its retention size: that much must fit where it lives (what it holds
    already counts), and never on the model disk (validate refuses that path)."""
    iid, title = "TSDB", "Free space for Prometheus's TSDB (retention size)"
    if not cfg.get("enabled", False):
        return Item(iid, title, "skip", "", "", "monitoring off, or another host runs Prometheus")
    path = Path(str(cfg.get("storage_path") or "/var/lib/prometheus/metrics2"))
    try:
        need_bytes = monitoring_config.size_bytes(str(cfg.get("retention_size", "")))
    except monitoring_config.MonitoringConfigError as err:
        return Item(iid, title, "blocked", "", str(cfg.get("retention_size")), str(err))
    used, free = dir_bytes(path), free_bytes(path)
    found = f"{human_bytes(free)} free at {nearest_existing(path)}"
    found += f", {human_bytes(used)} in {path}" if used else ""
    need = f">= {human_bytes(need_bytes)} (monitoring_prometheus_retention_size)"
    if free + used < need_bytes:
        return Item(iid, title, "blocked", found, need,
                    f"{human_bytes(need_bytes - free - used)} short: free space there, or a smaller retention size "
                    "or another monitoring_prometheus_storage_path")
    return Item(iid, title, "ok" if used else "will-change", found, need, "")


# ------------------------------------------------------------------ the run


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """All items for this host from the input configuration (see playbooks/preflight.yml)."""
    driver_cfg = cfg.get("driver", {})
    items: list[ReportRow] = [os_item(read_os_release())]
    pci = pci_nvidia_devices()
    nvml = nvidia.nvml_snapshot()
    proc_driver = nvidia.read_proc_driver()
    gpu_present = bool(pci or nvml.get("gpus"))
    require_gpu = bool(driver_cfg.get("require_gpu", True))
    driver_enabled = driver_cfg.get("enabled", True)
    items.append(gpu_item(pci, nvml, require_gpu) if driver_enabled
                 else Item("GPU", "GPUs (PCI and NVML)", "skip", "", "", "nvidia_driver_enabled: false"))
    running = proc_driver.get("driver_version") if proc_driver.get("loaded") else (
        str(nvml["driver_version"]) if nvml.get("available") else None)
    reboot = []
    if driver_enabled:
        required, required_why = required_driver(driver_cfg)
        item, needs_reboot = driver_plan(
            running=running, required=required, required_why=required_why,
            apt=driver_cfg.get("apt"), apt_reason=driver_cfg.get("apt_reason", ""), fix=driver_cfg.get("fix", ""),
            repo_pending=str(driver_cfg.get("repo_url") or "") if driver_cfg.get("repo_pending") else "",
            cpu_build=bool(driver_cfg.get("cpu_build")),
            install=bool(driver_cfg.get("install", True)), reboot_ok=bool(driver_cfg.get("reboot_ok")),
            # nvidia_driver_skip_gpu_check (lab/test only) walks the install decision without a GPU, as the role does.
            evaluate=gpu_present or require_gpu or bool(driver_cfg.get("skip_gpu_check")))
        items.append(item)
        if needs_reboot:
            reboot.append("driver")
    else:
        items.append(Item("DRV", "Driver: running vs required, apt candidate per source", "skip", "", "",
                          "nvidia_driver_enabled: false"))
    item, pending = kernel_flags_item(cfg.get("kernel_cmdline", {}), Path("/proc/cmdline").read_text(), proc_driver)
    items.append(item)
    if pending:
        reboot.append("kernel flags")
    model_cfg = cfg.get("model", {})
    model_dir = str(model_cfg.get("dir") or "/models/gpt-oss-20b")
    on_host = model_info(Path(model_dir))
    model = on_host if on_host.get("config") else (model_cfg.get("controller") or on_host)
    present = on_host.get("weight_bytes", 0) if on_host.get("config") else 0
    items.append(model_disk_item(cfg.get("model_mount", {}), model_dir,
                                 model.get("weight_bytes") if model.get("config") else None, present,
                                 Path("/proc/self/mountinfo").read_text()))
    vllm_cfg = cfg.get("vllm", {})
    items.append(venv_item(vllm_cfg))
    items.append(python_item(vllm_cfg))
    gpu_memory = ([int(g["memory_total_bytes"]) for g in nvml["gpus"] if isinstance(g.get("memory_total_bytes"), int)]
                  if nvml.get("available") and nvml.get("gpus") else None)
    items.append(memory_fit(model, vllm_cfg.get("flags", {}), gpu_memory))
    items.append(tsdb_item(cfg.get("monitoring", {})))
    items.append(Item("REBOOT", "Reboot needed after the converge", "will-change" if reboot else "ok",
                      ", ".join(reboot) if reboot else "no"))
    blocked = [i.id for i in items if i.status == "blocked"]
    return {"host": platform.node(), "ready": not blocked, "blocked": blocked, "reboot_needed": bool(reboot),
            "items": [i.to_dict(PREFLIGHT_COLUMNS) for i in items]}


# ------------------------------------------------------------------ controller-side report


def format_host(host: str, report: dict[str, Any]) -> str:
    if "error" in report:
        return f"== {host}: NO REPORT\n   {report['error']}"
    unknown = [item["id"] for item in report["items"] if item["status"] == "unknown"]
    lines = [f"== {host}: " + ("READY" if report["ready"] else "BLOCKED by " + ", ".join(report["blocked"]))
             + (f"  (not decided: {', '.join(unknown)})" if unknown else "")
             + ("  (reboot needed)" if report.get("reboot_needed") else "")]
    for item in report["items"]:
        lines.append(f"{item['id']:<6} {item['status'].upper():<11} {item['title']}")
        for key in ("found", "need", "fix"):
            if item.get(key):
                lines.append(f"{'':18}{key}: {item[key]}")
    return "\n".join(lines)


def report_hosts(reports: dict[str, dict[str, Any]], as_json: bool = False) -> int:
    """Print every host's report; exit 2 when a host was unreachable, 1 when one is blocked, else 0."""
    if as_json:
        print(json.dumps(reports, indent=2, sort_keys=True))
    else:
        print("\n\n".join(format_host(host, reports[host]) for host in sorted(reports)))
    if any("error" in r for r in reports.values()):
        return 2
    return 1 if any(not r.get("ready") for r in reports.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m service.host.preflight", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", help="evaluate this host")
    check.add_argument("--input", type=Path, help="input JSON from playbooks/preflight.yml (default: defaults)")
    check.add_argument("--json", action="store_true", help="print JSON instead of the table")
    info = sub.add_parser("model-info", help="print config.json and weight bytes of a model folder as JSON")
    info.add_argument("model_dir", type=Path)
    req = sub.add_parser("required-driver", help="print the minimum driver for a CUDA version and floor as JSON")
    req.add_argument("--cuda", required=True, help="nvidia_driver_cuda_version (X.Y or auto)")
    req.add_argument("--floor", default=nvidia.PROJECT_DRIVER_FLOOR, help="nvidia_driver_floor")
    sub.required = True
    args = parser.parse_args(argv)
    if args.command == "model-info":
        print(json.dumps(model_info(args.model_dir)))
        return 0
    if args.command == "required-driver":
        required, why = required_driver({"cuda_version": args.cuda, "floor": args.floor})
        print(json.dumps({"required": required, "why": why}))
        return 0
    input_path = args.input
    try:
        cfg = json.loads(input_path.read_text()) if input_path else {}
    except (OSError, json.JSONDecodeError) as err:
        print(f"error: --input {input_path}: {err}", file=sys.stderr)
        return 2
    if not isinstance(cfg, dict):
        print(f"error: --input {input_path}: expected a JSON object", file=sys.stderr)
        return 2
    report = run(cfg)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_host(report["host"], report))
    return 0 if report["ready"] else 1


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
