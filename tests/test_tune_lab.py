"""Issue 7: invoke tune completes a small sweep against the lab's real vLLM and restores the server."""

from __future__ import annotations

import json

from conftest import ROOT, Lab, run_invoke


def test_small_sweep_rejects_the_invalid_candidate_and_restores(lab: Lab):
    before = lab.checksums("/etc/gptoss/vllm-args.json", "/etc/systemd/system/gptoss-vllm.service")
    result = run_invoke("tune", "--max-num-seqs", "2", "--max-num-batched-tokens", "128,256", "--chunked", "off",
                        "--ttft-p95-ms", "600000", "--concurrency", "2", "--num-prompts", "6",
                        env=lab.env, timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    trials = json.loads((ROOT / ".cache" / "tune" / "trials.json").read_text())
    by_tokens = {t["overrides"]["max-num-batched-tokens"]: t for t in trials}
    # 128 batched tokens cannot hold one 256-token prompt without chunked prefill: refused before rollout.
    assert by_tokens[128]["status"] == "rejected"
    assert by_tokens[256]["status"] == "ok" and by_tokens[256]["output_tok_s"] > 0
    assert "<- best" in output and "winner not accepted" in output
    assert lab.checksums("/etc/gptoss/vllm-args.json", "/etc/systemd/system/gptoss-vllm.service") == before
    assert not (ROOT / "inventory" / "host_vars" / lab.state.machine_name / "vllm_tuned.yml").exists()
