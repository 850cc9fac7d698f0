"""bench/nccl_allreduce.py on CPUs (gloo): each variant's file is the role's rule, and its variables
(plus NVLink multicast off) are exactly what the worker processes run with. NCCL speed itself is
only measured on GPUs (issue 18)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.gptoss.host.plugins.module_utils import nccl_policy  # noqa: E402


def test_each_variant_runs_under_the_file_the_role_would_write(tmp_path: Path):
    out = tmp_path / "result.json"
    env = {**os.environ, "NCCL_DEBUG": "INFO"}  # a stray variable of the caller must not leak in
    proc = subprocess.run([sys.executable, "bench/nccl_allreduce.py", "--backend", "gloo", "--world-size", "2",
                           "--sizes", "1MiB,2MiB", "--iters", "2", "--warmup", "1", "--variants", "p2p-off,ib-off",
                           "--out-dir", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "p2p-off busbw GB/s" in proc.stdout and "ib-off us" in proc.stdout
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == ["p2p-off", "ib-off"]
    for name, (policy, ib_disable) in (("p2p-off", ("disable", False)), ("ib-off", ("enable", True))):
        result = variants[name]
        rule = nccl_policy.policy_file(policy, None, ib_disable=ib_disable)
        assert (tmp_path / f"nccl-{name}.env").read_text() == rule["content"]
        for seen in result["ranks_env"]:
            assert seen == {**rule["variables"], "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}
        assert [row["bytes"] for row in result["sizes"]] == [1 << 20, 2 << 20]
        for row in result["sizes"]:
            assert row["time_us"] > 0 and row["algbw_gbs"] > 0
            assert abs(row["busbw_gbs"] - row["algbw_gbs"]) < 1e-9  # 2(n-1)/n == 1 for n=2
    assert variants["p2p-off"]["variables"]["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in variants["ib-off"]["variables"]
