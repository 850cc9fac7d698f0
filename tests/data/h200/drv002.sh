#!/bin/bash
# DRV-002 on the GPU machine: the CUDA of the torch installed there against the running driver.
set -u
L=$PWD/.devcarry/lib
export PYTHONPATH=$L PYTHONUNBUFFERED=1
cd "$L"  # so python -m service.X takes this copy, not the checkout's service/
exec > >(tee "$OUT/drv002_gpu.log") 2>&1
echo "== host"; date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
head -1 /proc/driver/nvidia/version
PY=$(command -v python3); echo "python3: $PY ($($PY --version 2>&1))"
SITE=$($PY -c 'import importlib.util,os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("torch").origin)))')
PREFIX=$(dirname "$(dirname "$(dirname "$SITE")")")
echo "torch package folder: $SITE/torch   prefix given to DRV-002 as vllm_venv: $PREFIX"
echo "== torch.version.cuda by importing torch (what the file read must agree with)"
/usr/bin/time -f "import torch took %e s" $PY -c 'import torch; print("torch", torch.__version__, "| torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available())'
echo "== the same from torch/version.py without importing (version_chain.installed_torch)"
$PY - "$PREFIX" <<'PYEOF'
import sys, time
from ansible_collections.gptoss.host.plugins.module_utils import version_chain as vc
t = time.perf_counter(); r = vc.installed_torch(sys.argv[1]); ms = (time.perf_counter() - t) * 1000
print(r, f"read in {ms:.2f} ms")
PYEOF
cp "$SITE/torch/version.py" "$OUT/torch_version.py"  # kept as tests/data/h200/torch_version.py.txt
mk() { mkdir -p "$1"; printf '{"require_gpu": true, "min_driver": "535", "vllm_venv": "%s", "gpu_count": 1, "gpu_name_contains": "H200", "p2p_expected": "any"}\n' "$2" > "$1/nvidia_driver.json"; cat "$1/nvidia_driver.json"; }
echo "== DRV-002 against the installed torch (expect pass)"
mk /tmp/real.d "$PREFIX"
$PY -m service.host.verify --config-dir /tmp/real.d --only DRV-001,DRV-002; echo "exit $?"
$PY -m service.host.verify --config-dir /tmp/real.d --only DRV-002 --json > "$OUT/drv002_pass.json"
echo "== DRV-002 against a torch/version.py that claims a CUDA 13.1 build (expect fail: 13.1 needs 590.44.01)"
FAKE=/tmp/fake-venv; PYV=$($PY -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
mkdir -p "$FAKE/lib/$PYV/site-packages/torch"
sed -e "s/^__version__ = .*/__version__ = '2.11.0+cu131'/" -e "s/^cuda\(: Optional\[str\]\)\? = .*/cuda: Optional[str] = '13.1'/" "$SITE/torch/version.py" > "$FAKE/lib/$PYV/site-packages/torch/version.py"
grep -E "^(__version__|cuda)" "$FAKE/lib/$PYV/site-packages/torch/version.py"
mk /tmp/fake.d "$FAKE"
$PY -m service.host.verify --config-dir /tmp/fake.d --only DRV-001,DRV-002; echo "exit $?"
$PY -m service.host.verify --config-dir /tmp/fake.d --only DRV-002 --json > "$OUT/drv002_fail.json"
echo "== done"; date -u
