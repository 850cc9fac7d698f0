"""service.host.nvidia / service.host.checks / service.host.verify against this machine's real /proc, real mounts,
real child processes, a real HTTP server, and the real outputs captured on an H200 (tests/data/h200)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import JsonHandler, contract_record

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ansible_collections.gptoss.host.plugins.module_utils import mountinfo  # noqa: E402

from service.host import checks, nvidia, verify  # noqa: E402

H200 = ROOT / "tests" / "data" / "h200"
H200_VERIFY_D = ROOT / "tests" / "data" / "h200-verify.d"
H200_TORCH_VERSION = H200 / "torch_version.py.txt"  # torch/version.py of torch 2.11.0+cu130 on the H200
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def ctx_for(roles: dict, **kwargs) -> checks.Context:
    return checks.Context(roles, **kwargs)


def by_id(results: list[checks.CheckResult]) -> dict[str, checks.CheckResult]:
    return {r.id: r for r in results}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI as the host runs it: system python3, stdlib only, from the repo root."""
    return subprocess.run([SYSTEM_PYTHON, "-m", "service.host.verify", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)


def write_roles(directory: Path, roles: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in roles.items():
        (directory / f"{name}.json").write_text(json.dumps(contract_record(name, **data)))
    return directory


# ------------------------------------------------------------------ parsers on real H200 captures


def test_proc_version_and_params_from_h200_capture():
    text = (H200 / "proc.txt").read_text()
    assert nvidia.parse_proc_version(text) == {"driver_version": "580.159.04", "kernel_module": "open"}
    params = nvidia.parse_proc_params(text)
    assert params["EnableGpuFirmware"] == "18"
    assert params["UsePageAttributeTable"] == "4294967295"
    assert params["DynamicPowerManagement"] == "3"


def test_proc_version_proprietary_module_and_garbage():
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    assert nvidia.parse_proc_version(line) == {"driver_version": "535.104.05", "kernel_module": "proprietary"}
    with pytest.raises(ValueError):
        nvidia.parse_proc_version("GCC version: gcc 12\n")


# The CUDA -> driver table's own tests live in tests/test_version_chain.py (its one home).


def test_h200_nvml_snapshot_values():
    snap = json.loads((H200 / "nvml.json").read_text())
    assert snap["cuda_driver_version_raw"] == 13000
    assert nvidia.cuda_driver_version_text(snap["cuda_driver_version_raw"]) == snap["cuda_driver_version"] == "13.0"
    gpu = snap["gpus"][0]
    assert (gpu["pcie_gen_current"], gpu["pcie_width_max"], gpu["persistence_mode"]) == (5, 16, 1)
    assert gpu["gsp_firmware_mode"] == [1, 1]
    assert nvidia.p2p_supported_all_pairs(snap) is None  # one GPU


def test_p2p_all_pairs():
    two = {"available": True, "gpus": [{}, {}], "p2p": [{"a": 0, "b": 1, "status": "ok"}]}
    assert nvidia.p2p_supported_all_pairs(two) is True
    two["p2p"][0]["status"] = "chipset_not_supported"
    assert nvidia.p2p_supported_all_pairs(two) is False


def test_nvml_snapshot_on_this_machine_never_crashes():
    snap = nvidia.nvml_snapshot()
    assert snap["available"] is True or snap["reason"]


# ------------------------------------------------------------------ GPU checks from the real H200 snapshot


def h200_ctx(roles: dict) -> checks.Context:
    ctx = ctx_for(roles)
    snap = json.loads((H200 / "nvml.json").read_text())
    # Feed the captured device facts in place of this GPU-less machine's live reads.
    ctx.__dict__["nvml"] = snap
    ctx.__dict__["proc_driver"] = snap["proc"]
    return ctx


def torch_venv(root: Path, version_py: str) -> str:
    """A venv layout holding only torch/version.py, the file DRV-002 reads (as torch.version does)."""
    folder = root / "lib" / "python3.11" / "site-packages" / "torch"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "version.py").write_text(version_py)
    return str(root)


def h200_torch_claiming(cuda: str) -> str:
    """The real torch/version.py of the H200 (2.11.0+cu130), its CUDA line changed to `cuda`."""
    text = H200_TORCH_VERSION.read_text()
    assert "cuda: Optional[str] = '13.0'" in text
    return text.replace("cuda: Optional[str] = '13.0'", f"cuda: Optional[str] = {cuda!r}").replace(
        "'2.11.0+cu130'", f"'2.11.0+cu{cuda.replace('.', '')}'")


def test_gpu_checks_on_h200_capture(tmp_path):
    driver_role = json.loads((H200_VERIFY_D / "nvidia_driver.json").read_text())
    driver_role["vllm_venv"] = torch_venv(tmp_path, H200_TORCH_VERSION.read_text())
    roles = {"nvidia_driver": driver_role,
             "kernel_cmdline": {"flags": ["nvidia.NVreg_EnableGpuFirmware=1", "nvidia.NVreg_UsePageAttributeTable=1",
                                          "nvidia.NVreg_DynamicPowerManagement=3"]}}
    res = by_id(checks.run_checks(h200_ctx(roles), {"DRV-001", "DRV-002", "GPU-001", "GPU-002", "GPU-003",
                                                     "GPU-004", "KRN-002"}))
    assert {k: v.status for k, v in res.items()} == {
        "DRV-001": "pass", "DRV-002": "pass", "GPU-001": "pass", "GPU-002": "pass", "GPU-003": "pass",
        "GPU-004": "skip", "KRN-002": "fail"}
    assert res["DRV-002"].expected.startswith("driver >= 580.65.06, NVML CUDA >= 13.0 (torch 2.11.0+cu130")
    assert "EnableGpuFirmware: 18 = mode 2" in res["KRN-002"].reason
    assert "UsePageAttributeTable: 4294967295 = unset" in res["KRN-002"].reason
    assert "DynamicPowerManagement" not in res["KRN-002"].reason  # 3 == 3


def test_gpu_checks_fail_on_wrong_expectations(tmp_path):
    roles = {"nvidia_driver": {"min_driver": "590", "vllm_venv": torch_venv(tmp_path, H200_TORCH_VERSION.read_text()),
                               "gpu_count": 2, "gpu_name_contains": "4090 D"}}
    ctx = h200_ctx(roles)
    ctx.nvml["cuda_driver_version"] = "12.8"  # what an R570 driver reports
    res = by_id(checks.run_checks(ctx, {"DRV-001", "DRV-002", "GPU-001"}))
    assert res["DRV-001"].status == "fail" and "older than the floor 590" in res["DRV-001"].reason
    assert res["DRV-002"].status == "fail" and "CUDA API is 12.8" in res["DRV-002"].reason
    assert res["GPU-001"].status == "fail" and "expected 2 GPUs" in res["GPU-001"].reason


def test_drv002_reads_the_installed_torch_never_the_record(tmp_path):
    """A torch that claims CUDA 13.1 needs 590.44.01 > the H200's 580.159.04: fail, whatever the record says."""
    venv = torch_venv(tmp_path, h200_torch_claiming("13.1"))
    ctx = h200_ctx({"nvidia_driver": {"vllm_venv": venv, "cuda_version": "12.8"}})  # the old inventory claim
    res = checks.check_driver_for_cuda(ctx)
    assert res.status == "fail"
    assert "torch 2.11.0+cu131 is a CUDA 13.1 build, which needs driver >= 590.44.01; found 580.159.04" in res.reason
    assert "the driver's CUDA API is 13.0, older than the build's 13.1" in res.reason


def test_drv002_skips_and_errors(tmp_path):
    def status(role: dict) -> tuple[str, str]:
        res = checks.check_driver_for_cuda(h200_ctx({"nvidia_driver": role}))
        return res.status, res.reason

    assert status({}) == ("skip", "nvidia_driver.json names no vllm_venv")
    assert status({"vllm_venv": str(tmp_path / "empty")})[0] == "skip"  # vllm_service not applied yet
    cpu = torch_venv(tmp_path / "cpu", "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert status({"vllm_venv": cpu}) == ("skip", "torch 2.13.0+cpu is a CPU build: it needs no NVIDIA driver")
    newer = torch_venv(tmp_path / "new", h200_torch_claiming("14.0"))
    assert status({"vllm_venv": newer})[0] == "error"  # newer than the table: no guess
    broken = torch_venv(tmp_path / "broken", "cuda = (\n")
    assert status({"vllm_venv": broken})[0] == "error"


def test_pcie_rule_gen_downtrained_passes_width_short_fails():
    ctx = h200_ctx({"nvidia_driver": {}})
    gpu = ctx.nvml["gpus"][0]
    gpu["pcie_gen_current"] = 1
    assert checks.check_pcie_link(ctx).status == "pass"
    assert "idle downtraining" in checks.check_pcie_link(ctx).reason
    gpu["pcie_width_current"] = 8
    assert checks.check_pcie_link(ctx).status == "fail"


def test_p2p_expectation_against_two_gpus():
    def two_gpus(expected: str) -> checks.Context:
        ctx = h200_ctx({"nvidia_driver": {"p2p_expected": expected}})
        ctx.nvml["gpus"].append(dict(ctx.nvml["gpus"][0], index=1))
        ctx.nvml["p2p"] = [{"a": 0, "b": 1, "status": "chipset_not_supported", "code": 1}]
        return ctx

    assert checks.check_p2p(two_gpus("unsupported")).status == "pass"
    assert checks.check_p2p(two_gpus("supported")).status == "fail"


def test_no_gpu_here_is_skip_or_fail_by_require_gpu():
    if nvidia.read_proc_driver().get("loaded"):
        pytest.skip("this machine has an NVIDIA driver")
    skip = by_id(checks.run_checks(ctx_for({"nvidia_driver": {"require_gpu": False}}), {"DRV-001", "GPU-002"}))
    fail = by_id(checks.run_checks(ctx_for({"nvidia_driver": {"require_gpu": True}}), {"DRV-001", "GPU-002"}))
    assert skip["DRV-001"].status == skip["GPU-002"].status == "skip"
    assert fail["DRV-001"].status == fail["GPU-002"].status == "fail"


# ------------------------------------------------------------------ kernel cmdline, mounts, CPU


def test_cmdline_flags_against_real_proc_cmdline(tmp_path):
    words = Path("/proc/cmdline").read_text().split()
    present = next(w for w in words if "=" in w)
    key, value = present.split("=", 1)
    ok = checks.check_cmdline_flags(ctx_for({"kernel_cmdline": {"flags": [present]}}))
    assert ok.status == "pass", ok
    bad = checks.check_cmdline_flags(ctx_for({"kernel_cmdline": {"flags": [f"{key}={value}x",
                                                                          "nvidia.NVreg_EnableGpuFirmware=1"]}}))
    assert bad.status == "fail" and "nvidia.NVreg_EnableGpuFirmware: absent" in bad.reason


def test_mountinfo_parser_unescapes_and_splits_options():
    line = r"339 27 0:55 / /srv/m\040t rw,noatime shared:5 - ext4 /dev/loop0 rw,nobarrier"
    [m] = mountinfo.parse(line)
    assert m["mount_point"] == "/srv/m t" and m["fstype"] == "ext4" and m["source"] == "/dev/loop0"
    assert m["mount_options"] == ["rw", "noatime"] and m["super_options"] == ["rw", "nobarrier"]


@pytest.fixture
def tmpfs_mount(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "models dir"  # a space, so the \040 escape is exercised on a real mount
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noatime,size=1m", "tmpfs", str(point)], check=True)
    yield point
    subprocess.run(["umount", str(point)], check=True)


def test_model_mount_on_real_tmpfs(tmpfs_mount):
    good = {"mount_point": str(tmpfs_mount), "fstype": "tmpfs", "options": ["noatime", "size=1024k"]}
    assert checks.check_model_mount(ctx_for({"model_mount": good})).status == "pass"
    wrong_fs = checks.check_model_mount(ctx_for({"model_mount": {**good, "fstype": "ext4"}}))
    assert wrong_fs.status == "fail" and "fstype tmpfs != ext4" in wrong_fs.reason
    missing = checks.check_model_mount(ctx_for({"model_mount": {**good, "options": ["noatime", "nobarrier"]}}))
    assert missing.status == "fail" and missing.reason == "option nobarrier missing"
    absent = checks.check_model_mount(ctx_for({"model_mount": {**good, "mount_point": str(tmpfs_mount / "x")}}))
    assert absent.status == "fail" and absent.found == "not mounted"


def test_cpu_governor_here_and_on_a_sysfs_shaped_tree(tmp_path):
    real = checks.check_cpu_governor(ctx_for({"cpu_governor": {"governor": "performance"}}))
    assert real.status in ("pass", "fail", "skip")
    if not list(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor")):
        assert real.status == "skip" and "cpufreq not supported" in real.reason
    for n, gov in enumerate(["performance", "powersave", "performance"]):
        (tmp_path / f"cpu{n}" / "cpufreq").mkdir(parents=True)
        (tmp_path / f"cpu{n}" / "cpufreq" / "scaling_governor").write_text(gov + "\n")
    tree = checks.check_cpu_governor(ctx_for({"cpu_governor": {"governor": "performance"}}, cpu_root=tmp_path))
    assert tree.status == "fail" and tree.found == "2/3 CPUs performance" and "cpu1=powersave" in tree.reason


# ------------------------------------------------------------------ processes and systemd


@pytest.fixture
def vllm_like_tree():
    """A real parent with a real child, both with NCCL variables in their environ."""
    env = {**os.environ, "NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    code = ("import subprocess,sys,os,time;"
            "env=dict(os.environ,NCCL_IB_DISABLE='0');"
            "c=subprocess.Popen([sys.executable,'-c','import time;time.sleep(30)'],env=env);"
            "print(c.pid,flush=True);time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    yield parent.pid, child_pid
    os.kill(child_pid, 15)
    parent.kill()
    parent.wait()


def test_env_check_walks_children_and_names_the_pid(vllm_like_tree):
    parent, child = vllm_like_tree
    assert checks.process_tree(parent) == sorted([parent, child])
    ok = checks.check_nccl_env(ctx_for({"nccl_env": {"variables": {"NCCL_P2P_DISABLE": "1"}}, "vllm_service": {}},
                                       main_pid=parent))
    assert ok.status == "pass" and "2 process(es)" in ok.found
    bad = checks.check_nccl_env(ctx_for({"nccl_env": {"variables": {"NCCL_IB_DISABLE": "1", "NCCL_ALGO": "Ring"}},
                                         "vllm_service": {}}, main_pid=parent))
    assert bad.status == "fail"
    assert f"PID {child}: NCCL_IB_DISABLE='0' (want '1')" in bad.reason
    assert f"PID {parent}: NCCL_ALGO missing" in bad.reason


def test_env_check_skips_where_no_vllm_service_was_applied(vllm_like_tree):
    parent, _ = vllm_like_tree
    # Even with a live process to read, no vllm_service.json means no service these variables are for.
    result = checks.check_nccl_env(ctx_for({"nccl_env": {"variables": {"NCCL_P2P_DISABLE": "1"}}}, main_pid=parent))
    assert result.status == "skip" and "vllm_service.json absent" in result.reason


def test_svc_checks_without_systemd_report_error_not_crash():
    res = by_id(checks.run_checks(ctx_for({"vllm_service": {"argv": ["x"]}, "nccl_env": {"variables": {}}}),
                                  {"SVC-001", "SVC-002", "SVC-003", "ENV-001"}))
    if Path("/proc/1/comm").read_text().strip() == "systemd":
        pytest.skip("systemd is PID 1 here; the lab tests cover the live unit")
    for cid in ("SVC-001", "SVC-002", "SVC-003", "ENV-001"):
        assert res[cid].status == "error", res[cid]
        assert "systemd" in res[cid].reason or "systemctl" in res[cid].reason


def test_cmdline_compare_names_first_differing_arg():
    ctx = ctx_for({"vllm_service": {"argv": Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
                                    .rstrip(b"\0").decode().split("\0")}}, main_pid=os.getpid())
    assert checks.check_cmdline_matches(ctx).status == "pass"
    ctx.role("vllm_service")["argv"][1] = "--other"
    bad = checks.check_cmdline_matches(ctx)
    assert bad.status == "fail" and bad.reason.startswith("arg 1: running ") and "'--other'" in bad.reason


# ------------------------------------------------------------------ HTTP API against a real server

API_KEY = "sk-test-secret-123"


class FakeVllm(JsonHandler):
    """A tiny OpenAI-shaped server: /health, authenticated /v1/models and /v1/completions."""

    broken_completion = False
    delay_s = 0.0  # before every answer but /health's: a busy engine

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {API_KEY}"

    def do_GET(self):
        if self.path == "/health":
            return self._send(200)
        if not self._authorized():
            return self._send(401, {"error": "unauthorized"})
        if self.path == "/v1/models":
            time.sleep(self.delay_s)
            return self._send(200, {"data": [{"id": "gpt-oss-20b"}]})
        return self._send(404)

    def do_POST(self):
        if not self._authorized():
            return self._send(401)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.broken_completion:
            return self._send(500, {"error": "engine dead"})
        time.sleep(self.delay_s)
        self._send(200, {"choices": [{"text": " world"}],
                         "usage": {"completion_tokens": min(2, request["max_tokens"])}})


@pytest.fixture
def api_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    FakeVllm.broken_completion = False
    FakeVllm.delay_s = 0.0


def api_roles(server, tmp_path, key: str = API_KEY) -> dict:
    secrets = tmp_path / "vllm-secrets.env"
    secrets.write_text(f"# rendered by vllm_service\nVLLM_API_KEY='{key}'\n")
    return {"vllm_service": {"base_url": f"http://127.0.0.1:{server.server_address[1]}",
                             "served_model_name": "gpt-oss-20b", "api_key_file": str(secrets)}}


def test_api_checks_pass_with_key(api_server, tmp_path):
    res = by_id(checks.run_checks(ctx_for(api_roles(api_server, tmp_path)), {"API-001", "API-002", "API-003"}))
    assert [res[c].status for c in ("API-001", "API-002", "API-003")] == ["pass"] * 3
    assert res["API-003"].found.startswith("2 tokens in ")
    assert all(API_KEY not in str(r.to_dict()) for r in res.values())


def test_api_checks_fail_on_wrong_key_wrong_model_and_500(api_server, tmp_path):
    res = by_id(checks.run_checks(ctx_for(api_roles(api_server, tmp_path, key="wrong")), {"API-002", "API-003"}))
    assert res["API-002"].status == "fail" and "API key rejected" in res["API-002"].reason
    assert res["API-003"].status == "fail" and res["API-003"].found == "HTTP 401"
    roles = api_roles(api_server, tmp_path)
    roles["vllm_service"]["served_model_name"] = "other"
    assert checks.check_models(ctx_for(roles)).status == "fail"
    FakeVllm.broken_completion = True
    broken = checks.check_completion(ctx_for(api_roles(api_server, tmp_path)))
    assert broken.status == "fail" and "engine dead" in broken.reason


def test_a_completion_may_wait_longer_than_the_per_request_timeout(api_server, tmp_path):
    """--timeout bounds /health and /v1/models; a completion queues behind the engine's other requests
    and gets at least COMPLETION_TIMEOUT_S, so a busy server is not reported as one that cannot serve."""
    FakeVllm.delay_s = 1.0
    res = by_id(checks.run_checks(ctx_for(api_roles(api_server, tmp_path), timeout=0.5), {"API-002", "API-003"}))
    assert (res["API-002"].status, res["API-002"].found) == ("fail", "no response")
    assert res["API-003"].status == "pass" and res["API-003"].found.startswith("2 tokens in 1")


def test_replica_instances_are_checked_one_by_one_and_a_dead_one_hides_nothing(api_server, tmp_path):
    serving = api_roles(api_server, tmp_path)["vllm_service"]
    roles = {"vllm_service@0": {**serving, "unit": "gptoss-vllm@0.service"},
             "vllm_service@1": {**serving, "unit": "gptoss-vllm@1.service", "base_url": "http://127.0.0.1:9"}}
    res = by_id(checks.run_checks(ctx_for(roles, timeout=0.5), {"API-001", "API-002", "MNT-001"}))
    assert set(res) == {"API-001@0", "API-002@0", "API-001@1", "API-002@1", "MNT-001"}
    assert (res["API-001@0"].status, res["API-002@0"].status) == ("pass", "pass")
    assert (res["API-001@1"].status, res["API-001@1"].found) == ("fail", "no response")
    assert res["API-001@1"].title.endswith("(gptoss-vllm@1.service)")
    assert res["MNT-001"].status == "skip"  # a host-wide check runs once


def test_api_unreachable_fails_fast(tmp_path):
    roles = {"vllm_service": {"base_url": "http://127.0.0.1:9", "served_model_name": "m"}}
    start = time.monotonic()
    res = checks.check_health(ctx_for(roles, timeout=0.5))
    assert res.status == "fail" and res.found == "no response"
    assert time.monotonic() - start < 1.0


def test_no_completion_skips_api_003(api_server, tmp_path):
    res = checks.check_completion(ctx_for(api_roles(api_server, tmp_path), no_completion=True))
    assert res.status == "skip"


# ------------------------------------------------------------------ model weights


def test_model_weights_pickle_only_dir_names_the_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    res = checks.check_model_weights(ctx_for({"model_weights": {"model_dir": str(tmp_path)}}))
    assert res.status == "fail" and "pytorch_model.bin: pickle weights without safetensors" in res.reason


def test_model_weights_valid_and_truncated_safetensors(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    good = len(header).to_bytes(8, "little") + header + b"\0" * 8
    (tmp_path / "model.safetensors").write_bytes(good)
    ctx = ctx_for({"model_weights": {"model_dir": str(tmp_path)}})
    assert checks.check_model_weights(ctx).status == "pass"
    (tmp_path / "model.safetensors").write_bytes(good[:-3])
    bad = checks.check_model_weights(ctx)
    assert bad.status == "fail" and "model.safetensors" in bad.reason


# ------------------------------------------------------------------ CLI: output formats, waivers, exit codes


@pytest.fixture
def mixed_config(tmp_path, tmpfs_mount):
    """One passing check (MNT-001), one failing (KRN-001), the rest skipped."""
    return write_roles(tmp_path / "verify.d", {
        "model_mount": {"mount_point": str(tmpfs_mount), "fstype": "tmpfs", "options": ["noatime"]},
        "kernel_cmdline": {"flags": ["nvidia.NVreg_EnableGpuFirmware=1"]},
    })


def test_cli_json_and_junit_parse_back(mixed_config, tmp_path):
    junit = tmp_path / "out.xml"
    proc = run_cli("--config-dir", str(mixed_config), "--json", "--junit", str(junit))
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    status = {r["id"]: r["status"] for r in report["results"]}
    assert status["MNT-001"] == "pass" and status["KRN-001"] == "fail" and status["SVC-001"] == "skip"
    assert report["summary"]["fail"] == 1 and report["summary"]["ok"] is False and report["host"]
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = {c.get("name").split()[0]: c for c in suite.iter("testcase")}
    assert len(cases) == len(checks.CHECK_IDS)
    assert cases["KRN-001"].find("failure") is not None
    assert cases["SVC-001"].find("skipped").get("message").startswith("role not applied")
    assert list(cases["MNT-001"]) == []


def test_cli_waivers_valid_expired_and_bad(mixed_config, tmp_path):
    waivers = tmp_path / "waivers.json"
    waivers.write_text(json.dumps([{"id": "KRN-001", "reason": "reboot scheduled Friday"}]))
    junit = tmp_path / "w.xml"
    proc = run_cli("--config-dir", str(mixed_config), "--waivers", str(waivers), "--junit", str(junit))
    assert proc.returncode == 0, proc.stdout
    assert "WAIVED" in proc.stdout and "[waived: reboot scheduled Friday]" in proc.stdout
    case = next(c for c in ET.parse(junit).iter("testcase") if c.get("name").startswith("KRN-001"))
    assert case.find("skipped").get("message") == "waived: reboot scheduled Friday"

    yesterday = (dt.date.today() - dt.timedelta(days=1)).isoformat()
    waivers.write_text(json.dumps([{"id": "KRN-001", "reason": "old", "expires": yesterday}]))
    expired = run_cli("--config-dir", str(mixed_config), "--waivers", str(waivers))
    assert expired.returncode == 1 and f"waiver for KRN-001 expired on {yesterday}: ignored" in expired.stdout

    for bad in ([{"id": "KRN-001", "reason": " "}], [{"id": "KRN-001"}], [{"id": "NOPE-1", "reason": "x"}],
                [{"id": "KRN-001", "reason": "x", "expires": "next week"}], {"id": "KRN-001"}):
        waivers.write_text(json.dumps(bad))
        proc = run_cli("--config-dir", str(mixed_config), "--waivers", str(waivers))
        assert proc.returncode == 2, (bad, proc.stdout)
        assert "waivers" in proc.stderr


def test_cli_exit_codes_for_tool_errors_and_all_pass(tmp_path, mixed_config):
    assert run_cli("--config-dir", str(tmp_path / "missing")).returncode == 2
    broken = write_roles(tmp_path / "broken", {})
    (broken / "nccl_env.json").write_text("{not json")
    proc = run_cli("--config-dir", str(broken), "--json")
    assert proc.returncode == 2 and "nccl_env.json" in json.loads(proc.stdout)["error"]
    assert run_cli("--config-dir", str(mixed_config), "--only", "XYZ-001").returncode == 2
    only = run_cli("--config-dir", str(mixed_config), "--only", "MNT-001,CPU-001", "--json")
    assert only.returncode == 0 and [r["id"] for r in json.loads(only.stdout)["results"]] == ["MNT-001", "CPU-001"]


def test_table_is_aligned():
    results = [checks.CheckResult("A-001", "t", "pass", "e", "f", "").to_dict(),
               checks.CheckResult("B-002", "a longer title", "fail", "x" * 80, "y", "why").to_dict()]
    lines = verify.format_table(results).splitlines()
    assert lines[0].index("STATUS") == lines[1].index("PASS") == lines[2].index("FAIL")
    assert lines[0].index("REASON") == lines[2].index("why")
    assert "…" in lines[2]  # the 80-char expected value is cut, the reason is not


def test_full_local_run_is_well_under_two_seconds(tmp_path, api_server, tmpfs_mount):
    """Every role file present, the way a converged host has them; no completion."""
    config = write_roles(tmp_path / "all.d", {
        **{k: v for k, v in api_roles(api_server, tmp_path).items()},
        "nvidia_driver": {"require_gpu": False, "vllm_venv": str(tmp_path / "venv")},
        "kernel_cmdline": {"flags": ["nvidia.NVreg_EnableGpuFirmware=1"]},
        "model_mount": {"mount_point": str(tmpfs_mount), "fstype": "tmpfs", "options": ["noatime"]},
        "cpu_governor": {"governor": "performance"},
        "nccl_env": {"variables": {"NCCL_P2P_DISABLE": "1"}},
        "model_weights": {"model_dir": str(tmp_path)},
    })
    start = time.monotonic()
    proc = run_cli("--config-dir", str(config), "--no-completion", "--json")
    wall = time.monotonic() - start
    report = json.loads(proc.stdout)
    assert len(report["results"]) == len(checks.CHECK_IDS)
    print(f"[timing] full local verify run: {wall:.2f}s wall, {report['duration_s']}s in checks")
    assert wall < 2.0


# ------------------------------------------------------------------ API-004 answer shapes


def call(name: str, arguments: str) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "assistant", "content": "It is sunny."}, ("message", "")),
        ({"role": "assistant", "content": ""}, ("message", "")),  # stopped at once: still a message
        ({"role": "assistant", "content": None, "reasoning_content": "The user asks"}, ("message", "")),
        ({"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris"}')]},
         ("tool call", "")),
    ],
)
def test_chat_answers_that_are_well_formed(message, expected):
    assert checks.classify_chat_message(message, {"get_weather"}) == expected


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"role": "assistant", "tool_calls": [call("rm_rf", "{}")]}, "call of an unknown tool"),
        ({"role": "assistant", "tool_calls": [call("get_weather", '{"city": ')]}, "arguments are not JSON"),
        ({"role": "assistant", "tool_calls": [call("get_weather", '["Paris"]')]}, "not a JSON object"),
        ({"role": "assistant", "tool_calls": ["get_weather"]}, "call of an unknown tool"),
        ({"role": "assistant", "content": None}, "neither tool_calls nor a content string"),
        ({"role": "assistant"}, "neither tool_calls nor a content string"),
        ("It is sunny.", "message is str"),
    ],
)
def test_chat_answers_that_are_broken_name_the_problem(message, problem):
    _, found = checks.classify_chat_message(message, {"get_weather"})
    assert problem in found


def test_chat_check_skips_with_no_completion(tmp_path, api_server):
    res = checks.check_chat(ctx_for(api_roles(api_server, tmp_path), no_completion=True))
    assert (res.id, res.status, res.reason) == ("API-004", "skip", "--no-completion")


# ------------------------------------------------------------------ WEB-001 (Open WebUI's sign-in and model list)

WEBUI_PASSWORD = 'admin pass "#1" $x'


class FakeWebui(JsonHandler):
    """Open WebUI's shape: /health, sign-in returning a token, /api/models only with that token."""

    models = ["gpt-oss-20b"]

    def do_GET(self):
        if self.path == "/health":
            return self._send(200, {"status": True})
        if self.path == "/api/models" and self.headers.get("Authorization") == "Bearer tok-1":
            return self._send(200, {"data": [{"id": m} for m in self.models]})
        return self._send(401)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/api/v1/auths/signin" and request == {"email": "admin@x.invalid", "password": WEBUI_PASSWORD}:
            return self._send(200, {"token": "tok-1"})
        return self._send(400, {"detail": "The email or password provided is incorrect."})


@pytest.fixture
def webui_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeWebui)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    FakeWebui.models = ["gpt-oss-20b"]


def webui_roles(server, tmp_path, password: str = WEBUI_PASSWORD) -> dict:
    secrets = tmp_path / "webui-secrets.env"
    secrets.write_text(checks.unit_inputs.env_file_text({"WEBUI_ADMIN_EMAIL": "admin@x.invalid",
                                                         "WEBUI_ADMIN_PASSWORD": password}))
    return {"webui": {"base_url": f"http://127.0.0.1:{server.server_address[1]}", "secrets_file": str(secrets)},
            "vllm_service": {"served_model_name": "gpt-oss-20b"}}


def test_web_001_passes_fails_and_never_prints_the_password(webui_server, tmp_path):
    good = checks.check_webui(ctx_for(webui_roles(webui_server, tmp_path)))
    assert good.status == "pass" and good.found == "gpt-oss-20b"
    wrong = checks.check_webui(ctx_for(webui_roles(webui_server, tmp_path, password="not-it-at-all")))
    assert wrong.status == "fail" and wrong.found == "HTTP 400" and "sign-in" in wrong.reason
    FakeWebui.models = []
    empty = checks.check_webui(ctx_for(webui_roles(webui_server, tmp_path)))
    assert empty.status == "fail" and "not listed" in empty.reason
    missing = webui_roles(webui_server, tmp_path)
    missing["webui"]["secrets_file"] = str(tmp_path / "absent.env")
    assert checks.check_webui(ctx_for(missing)).status == "error"
    assert all(WEBUI_PASSWORD not in str(r.to_dict()) for r in (good, wrong, empty))
