"""The converge receipt on the lab: drift in what the roles manage, or a changed input, runs the whole
converge (which repairs the drift) and a new receipt; nothing changed, and the run ends at once."""

from __future__ import annotations

import json
import os
import shutil
import time

from conftest import ROOT, Lab

HOLDS = "holds: inputs and managed live state unchanged, nothing to do"
RECEIPT = "/var/lib/gptoss/converge-receipt.json"


def said(output: str) -> str:
    """The play's output with whitespace runs as one space: the YAML callback folds long messages."""
    return " ".join(output.split())


def ends_on_the_receipt(lab: Lab, *args: str) -> None:
    result = lab.play("site.yml", *args)
    assert result.rc == 0 and HOLDS in said(result.output), result.output[-4000:]
    assert result.recap["changed"] == 0 and "TASK [nccl_env" not in result.output


def test_drift_in_a_managed_file_and_a_unit_runs_the_whole_converge_which_repairs_both(lab: Lab):
    ends_on_the_receipt(lab)
    env_file = "/etc/gptoss/nccl.env"
    original = lab.sh(f"cat {env_file}")
    receipt_before = lab.sh(f"cat {RECEIPT}")
    lab.ssh(f"echo NCCL_DEBUG=TRACE >> {env_file} && systemctl disable --quiet gptoss-cpu-governor.service")

    result = lab.play("site.yml")
    assert result.rc == 0, result.output[-5000:]
    why = said(result.output).partition("full converge: ")[2].partition(" changed since")[0]
    for part in ("files:/etc/gptoss", "files:/etc/systemd/system", "units"):
        assert part in why, why
    assert result.recap["changed"] >= 2
    assert lab.sh(f"cat {env_file}") == original
    assert lab.sh("systemctl is-enabled gptoss-cpu-governor.service").strip() == "enabled"
    assert lab.sh(f"cat {RECEIPT}") != receipt_before  # written again by the converge that repaired
    ends_on_the_receipt(lab)


def test_changed_inputs_run_the_whole_converge_and_a_narrowed_run_writes_no_receipt(lab: Lab, tmp_path):
    ends_on_the_receipt(lab, "--check", "--diff")
    # The lab's model is copied from the controller (model_weights_source_dir). A copy of it of our
    # own (the shared one is other labs' input too): the same files, so the host does not change.
    source = tmp_path / "model"
    shutil.copytree(ROOT / ".cache" / "tiny-llama-chat-bin", source)
    own_source = {"model_weights_source_dir": str(source)}
    result = lab.play("site.yml", extra_vars=own_source)
    assert result.rc == 0 and "full converge: inputs (project files, variables or controller files)" \
        in said(result.output), result.output[-5000:]
    assert result.recap["changed"] == 0, result.output[-5000:]  # the receipt is bookkeeping, not a change
    # A newer file in the controller folder is a changed input, though its content is the same.
    later = time.time() + 5
    os.utime(source / "config.json", (later, later))
    touched = lab.play("site.yml", extra_vars=own_source)
    assert touched.rc == 0 and "full converge: inputs" in said(touched.output), touched.output[-4000:]
    ends_on_the_receipt(lab, "-e", json.dumps(own_source))

    # --tags narrows a run: it runs (the inputs differ again) but writes no receipt.
    receipt = lab.sh(f"cat {RECEIPT}")
    tagged = lab.play("site.yml", "--tags", "nccl_env")
    assert tagged.rc == 0 and "full converge: inputs" in said(tagged.output), tagged.output[-4000:]
    assert "TASK [vllm_service : Roll out" not in tagged.output and lab.sh(f"cat {RECEIPT}") == receipt
    # The receipt left here names this test's model folder: the next plain converge runs every role
    # (its inputs differ) and writes a receipt of its own.
