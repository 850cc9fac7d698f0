"""controller.bench's NVML sampler against a real GPU under a real load (skipped without one).

CI has no GPU; this runs on the lent H200 (see the closing notes), where GPM gives true SM
utilization. The load is a torch matmul loop on the GPU, timed against the sampler.
"""

from __future__ import annotations

import threading
import time

import pytest

from controller.bench import NvmlSampler

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU here", allow_module_level=True)


def busy_gpu(seconds: float, stop: threading.Event) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.is_set():
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def sample_while(load_seconds: float | None) -> dict:
    sampler = NvmlSampler(enabled=True)
    assert sampler.status == "ok", sampler.status
    stop = threading.Event()
    sampler.start()
    if load_seconds:
        busy_gpu(load_seconds, stop)
    else:
        time.sleep(2.0)
    sampler.stop()
    return sampler.summary()


def test_sampler_sees_a_busy_gpu_and_an_idle_one() -> None:
    torch.cuda.init()
    idle = sample_while(None)["gpus"][0]
    busy_summary = sample_while(3.0)
    busy = busy_summary["gpus"][0]
    print("idle", idle, "\nbusy", busy)
    assert busy_summary["samples"] >= 10
    assert busy["gpu_util_pct"]["max"] >= 90 and busy["gpu_util_pct"]["mean"] >= 50
    assert busy["mem_used_mib"]["max"] > 256  # the matmul operands and the CUDA context
    assert idle["gpu_util_pct"]["max"] <= 20
    if busy["sm_util_pct"]["source"] == "GPM SM_UTIL":  # Hopper and newer
        assert busy["sm_util_pct"]["mean"] >= 50, busy
        assert idle["sm_util_pct"]["max"] <= 20, idle
    else:
        assert "reason" in busy["sm_util_pct"]
