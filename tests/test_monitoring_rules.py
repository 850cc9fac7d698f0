"""The monitoring rules, console pages and Grafana dashboard, proven by Debian 12's real promtool (2.42).

- The rules template is rendered by Ansible itself with the role's defaults (a two-host fleet inventory:
  a GPU host and a CPU lab host that needs no GPU), then `promtool check rules` and `promtool test rules`
  run the cases in tests/promtool/. Every alert needs a case where it fires and one where it must not.
- Every metric name a rule, page or dashboard uses exists: `vllm:` in the capture of a real vLLM's
  /metrics (tests/data/vllm-metrics-0.32.txt; tests/capture_vllm_metrics.py refreshes it, for the GPU
  build too), `gptoss_` in the GPU exporter's one family list (service.venv.gpu_exporter.FAMILY_NAMES),
  `node_` in tests/data/node-exporter-1.5-metrics.txt (Debian 12's binary run on a bookworm lab with
  --collector.systemd --collector.systemd.enable-restarts-metrics, one sample per family kept) and
  `probe_` in tests/data/blackbox-0.23-probe.txt (Debian 12's blackbox /probe of an https target).
- Every PromQL expression of the pages and the dashboard passes promtool. A real Prometheus 2.42 scrapes
  the captured vLLM /metrics (and a dead unit): every rule evaluates without error, VllmDown goes pending
  for the dead one, and the pages render the real figures (its console template engine, no error).

promtool and prometheus come from `invoke promtool` (.cache/tools; `invoke test` runs it first).
"""

from __future__ import annotations

import html
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from ansible_collections.gptoss.host.plugins.module_utils.mountinfo import mount_point_of

from service.host import monitoring_check
from service.venv.gpu_exporter import FAMILY_NAMES as GPU_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
ROLE = ROOT / "roles" / "monitoring"
TOOLS = ROOT / ".cache" / "tools" / "prometheus-2.42" / "usr"
PROMTOOL = TOOLS / "bin" / "promtool"
PROMETHEUS = TOOLS / "bin" / "prometheus"
CASES_DIR = ROOT / "tests" / "promtool"
VLLM_CAPTURE = ROOT / "tests" / "data" / "vllm-metrics-0.32.txt"
EXPORTER_CAPTURES = {"node_": ROOT / "tests" / "data" / "node-exporter-1.5-metrics.txt",
                     "probe_": ROOT / "tests" / "data" / "blackbox-0.23-probe.txt"}
RULES_TEMPLATE = ROOT / "templates" / "monitoring" / "gptoss.rules.yml.j2"
CONSOLES = sorted((ROLE / "files" / "consoles").glob("*.html"))
CONSOLE_LIBRARIES = ROLE / "files" / "console_libraries"
# The pages and our library (menu.lib queries the hosts); prom.lib is Prometheus's own.
CONSOLE_SOURCES = [*CONSOLES, CONSOLE_LIBRARIES / "menu.lib", CONSOLE_LIBRARIES / "gptoss.lib"]
GRAFANA = ROLE / "files" / "grafana" / "gptoss-dashboard.json"
RULES_FILE = "gptoss.rules.yml"  # the name tests/promtool/*.yml load
# The fleet the rules are rendered for: h1 (the Prometheus host, the default 4090d-x2 profile: 2 GPUs)
# and lab (a CPU host: its inventory says it needs no GPU).
INVENTORY = "[fleet]\nh1 ansible_connection=local\nlab ansible_connection=local monitoring_expected_gpus=0\n"
# Metric names a rule, page or dashboard uses, by the prefix of who serves them. Names right after a
# ':' or a word character are recording rules' (host_unit:vllm_...), not served metrics.
SERVED_NAME = re.compile(r"(?<![\w:])((?:vllm:|http_|gptoss_|node_|probe_)[a-zA-Z0-9_:]+)")


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not PROMTOOL.exists():
        pytest.fail(f"{PROMTOOL} missing: run `invoke promtool` (Debian 12's prometheus package, extracted)")
    return subprocess.run([str(PROMTOOL), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def run_with_role_vars(out_dir: Path, tasks: list[dict], extra_vars: dict | None = None) -> subprocess.CompletedProcess:
    """Tasks run by Ansible on this machine with the monitoring role's defaults and vars (and vLLM's profiles,
    which monitoring_expected_gpus derives from), for host h1 of the fleet above."""
    (out_dir / "inventory").write_text(f"{INVENTORY}[fleet:vars]\nansible_python_interpreter={sys.executable}\n")
    var_files = [*sorted((ROLE / "defaults" / "main").glob("*.yml")), ROLE / "vars" / "main.yml",
                 ROOT / "roles" / "vllm_service" / "defaults" / "main.yml",
                 ROOT / "roles" / "vllm_service" / "vars" / "profiles.yml"]
    play = [{"hosts": "h1", "gather_facts": False, "vars_files": [str(f) for f in var_files], "tasks": tasks}]
    (out_dir / "play.yml").write_text(yaml.safe_dump(play))
    # Extra vars: above the defaults files (vars_files), as an inventory's group_vars are above role defaults.
    extra = json.dumps({"monitoring_fleet_group": "fleet", **(extra_vars or {})})
    return subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(out_dir / "inventory"),
                           str(out_dir / "play.yml"), "-e", extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def render_rules(out_dir: Path, extra_vars: dict | None = None) -> Path:
    """The rules file as the role writes it: Ansible's template module with the role's defaults and vars."""
    proc = run_with_role_vars(out_dir, [{"name": "render", "ansible.builtin.template": {
        "src": str(RULES_TEMPLATE), "dest": str(out_dir / RULES_FILE), "mode": "0644"}}], extra_vars)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_dir / RULES_FILE


def validate_rules(out_dir: Path, extra_vars: dict | None = None) -> subprocess.CompletedProcess:
    return run_with_role_vars(out_dir, [{"name": "validate", "ansible.builtin.include_tasks":
                                         str(ROLE / "tasks" / "validate_rules.yml")}], extra_vars)


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rules")
    render_rules(out)
    for case in CASES_DIR.glob("*.yml"):
        shutil.copy(case, out / case.name)
    return out


@pytest.fixture(scope="module")
def rules(rules_dir: Path) -> list[dict]:
    return [rule for group in yaml.safe_load((rules_dir / RULES_FILE).read_text())["groups"]
            for rule in group["rules"]]


def case_files() -> list[Path]:
    return sorted(CASES_DIR.glob("*.yml"))


# ---------------------------------------------------------------- the rules


def test_promtool_checks_the_rendered_rules(rules_dir: Path, rules: list[dict]) -> None:
    proc = promtool("check", "rules", rules_dir / RULES_FILE)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"SUCCESS: {len(rules)} rules found", proc.stdout), proc.stdout


def test_every_alert_has_its_description_and_runbook(rules: list[dict]) -> None:
    alerts = [r for r in rules if "alert" in r]
    assert len(alerts) >= 18
    for alert in alerts:
        annotations = alert.get("annotations", {})
        assert annotations.get("description") and annotations.get("runbook"), alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]


def test_promtool_rule_cases_pass(rules_dir: Path) -> None:
    names = [f.name for f in case_files()]
    proc = promtool("test", "rules", *names, cwd=rules_dir)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.stdout.count("SUCCESS") == len(names), proc.stdout


def missing_cases(alerts: set[str], cases: list[Path]) -> dict[str, list[str]]:
    """Alerts without a case where they fire, without one where they must not, and cases of no alert."""
    fires: set[str] = set()
    must_not: set[str] = set()
    for path in cases:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else must_not).add(case["alertname"])
    return {"no firing case": sorted(alerts - fires), "no must-not case": sorted(alerts - must_not),
            "case of no alert": sorted((fires | must_not) - alerts)}


def test_every_alert_has_a_firing_and_a_must_not_case(rules: list[dict]) -> None:
    """A new alert without its two cases fails here (tests/promtool/README.md says how to add them)."""
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert missing_cases(alerts, case_files()) == {"no firing case": [], "no must-not case": [], "case of no alert": []}
    assert missing_cases(alerts | {"NewAlert"}, case_files())["no firing case"] == ["NewAlert"]
    assert missing_cases(alerts, case_files()[:1])["no must-not case"] != []


def test_the_expected_gpus_follow_each_hosts_profile(rules: list[dict]) -> None:
    """The default derives the count from the vLLM profile (4090d-x2: TP=2); the lab's inventory says 0."""
    expected = {r["labels"]["host"]: r["expr"] for r in rules if r.get("record") == "host:gptoss_gpu_expected:count"}
    assert expected == {"h1": "vector(2)", "lab": "vector(0)"}


def test_the_default_thresholds_pass_validate(tmp_path: Path) -> None:
    proc = validate_rules(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]


# Each refused input and the reason validate gives (all in one run: the assert lists every problem).
REFUSED = {
    "monitoring_slo_ttft_p95_ms": (800, "monitoring_slo_ttft_p95_ms 800 ms is not an edge of vLLM's histogram "
                                        "buckets (nearest: 750 and 1000 ms)"),
    "monitoring_slo_itl_p95_ms": ("fast", "monitoring_slo_itl_p95_ms 'fast' is not a positive number"),
    "monitoring_rules_gpu_hot_for": ("ten minutes", "monitoring_rules_gpu_hot_for 'ten minutes' is not a "
                                                    "Prometheus duration"),
    "monitoring_rules_kv_cache_ratio": (90, "monitoring_rules_kv_cache_ratio 90 is not a share between 0 and 1"),
    "monitoring_rules_restarts": (-1, "monitoring_rules_restarts -1 is not a number >= 0"),
    "monitoring_rules_restart_units": ("gptoss-(.*", "monitoring_rules_restart_units is not a regular expression"),
    "monitoring_rules_expected_gpus": ({"h1": 1.5}, "monitoring_rules_expected_gpus: h1: 1.5 is not a whole number"),
}


def test_refused_thresholds_stop_validate_each_with_its_reason(tmp_path: Path) -> None:
    """validate runs before anything changes: a refusal here means nothing on the host was touched."""
    proc = validate_rules(tmp_path, {name: value for name, (value, _) in REFUSED.items()})
    assert proc.returncode != 0
    missing = [message for _, message in REFUSED.values() if message not in proc.stdout]
    assert missing == [], proc.stdout[-3000:]


def test_a_broken_threshold_is_refused_by_promtool(tmp_path: Path) -> None:
    """What the role's `validate: promtool check rules` refuses before the live file is replaced."""
    path = render_rules(tmp_path, {"monitoring_rules_gpu_hot_for": "ten minutes"})
    proc = promtool("check", "rules", path)
    assert proc.returncode != 0
    assert "ten minutes" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- metric names


def exposition_names(path: Path) -> set[str]:
    return exposition_names_of(path.read_text())


def vllm_capture_names() -> set[str]:
    """Series names in every capture (the CPU build's, and a GPU build's where one sits beside it)."""
    captures = sorted(VLLM_CAPTURE.parent.glob("vllm-metrics-*.txt"))
    return set.intersection(*(exposition_names(path) for path in captures))


def served_names(text: str) -> set[str]:
    return set(SERVED_NAME.findall(text))


def gpu_family_names() -> set[str]:
    """The exporter's families as PromQL sees them (a counter's samples end in _total already)."""
    return set(GPU_FAMILIES)


def expressions_text(path: Path) -> str:
    """The PromQL of a file: a page's expressions only (its template names are no metrics), else all."""
    return "\n".join(console_expressions(path.read_text())) if path in CONSOLES else path.read_text()


@pytest.mark.parametrize("path", [RULES_TEMPLATE, GRAFANA, *CONSOLES], ids=lambda p: p.name)
def test_every_served_metric_name_exists(path: Path) -> None:
    """A renamed vLLM metric (gpu_cache_usage_perc -> kv_cache_usage_perc) breaks this, not a page at 3 a.m."""
    used = served_names(expressions_text(path))
    assert used, f"{path.name} names no served metric"
    vllm_missing = sorted(n for n in used if n.startswith(("vllm:", "http_")) and n not in vllm_capture_names())
    gpu_missing = sorted(n for n in used if n.startswith("gptoss_") and n not in gpu_family_names())
    exporter_missing = sorted(n for prefix, capture in EXPORTER_CAPTURES.items() for n in used
                              if n.startswith(prefix) and n not in exposition_names(capture))
    assert vllm_missing == [], f"not in {VLLM_CAPTURE.name}"
    assert gpu_missing == [], "not in service.venv.gpu_exporter.FAMILY_NAMES"
    assert exporter_missing == [], "not in the node/blackbox exporter captures"


H200_EXPORTER = ROOT / "tests" / "data" / "h200" / "gpu-exporter-idle.txt"
# Families served only when something happens (an XID, a lost NVML, an unsupported field, a failed read).
EVENT_ONLY = {"gptoss_gpu_xid_events_total", "gptoss_nvml_error_info", "gptoss_gpu_field_unsupported_info",
              "gptoss_nvml_read_errors_total"}


def test_the_exporter_on_a_real_gpu_serves_every_family_the_rules_read() -> None:
    """The exporter's /metrics on the H200 (bench/gpu_exporter_scrape.py --dump there, 2026-12-05): it
    declares exactly the families of FAMILY_NAMES, and every gptoss_gpu_* a rule, page or dashboard reads
    had a sample on a real card, except the event-only ones."""
    text = H200_EXPORTER.read_text().split("---- /metrics (last scrape) ----\n", 1)[1].split("\n---- ", 1)[0]
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP gptoss_")}
    served = {name for name in exposition_names_of(text) if name.startswith("gptoss_")}
    assert declared == set(GPU_FAMILIES)
    used = set().union(*(served_names(expressions_text(path)) for path in [RULES_TEMPLATE, GRAFANA, *CONSOLES]))
    unserved = sorted(n for n in used if n.startswith("gptoss_") and n not in served | EVENT_ONLY)
    assert unserved == [], "read by a rule or page, no sample on the H200"


def exposition_names_of(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_the_name_check_catches_a_renamed_metric() -> None:
    assert "vllm:gpu_cache_usage_perc" in served_names('max(vllm:gpu_cache_usage_perc{job="vllm"})')
    assert "vllm:gpu_cache_usage_perc" not in vllm_capture_names()
    assert "vllm:time_per_output_token_seconds_bucket" not in vllm_capture_names()
    assert served_names("host_unit:vllm_itl_seconds:p95_5m + host:gptoss_gpu_expected:count") == set()
    assert "node_systemd_service_restarts_total" not in exposition_names(EXPORTER_CAPTURES["node_"])
    assert "node_systemd_service_restart_total" in exposition_names(EXPORTER_CAPTURES["node_"])


def capture_buckets_ms(histogram: str) -> list[float]:
    edges = re.findall(rf'^{re.escape(histogram)}_bucket{{[^}}]*le="([^"]+)"', VLLM_CAPTURE.read_text(), re.M)
    return sorted({float(e) * 1000 for e in edges if e != "+Inf"})


def test_the_slos_sit_on_the_real_servers_bucket_edges() -> None:
    """p95 > an edge is exact; > a value inside a bucket is only histogram_quantile's linear guess."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main" / "rules.yml").read_text())
    assert capture_buckets_ms("vllm:time_to_first_token_seconds") == [float(b) for b in
                                                                      defaults["monitoring_vllm_ttft_buckets_ms"]]
    assert capture_buckets_ms("vllm:inter_token_latency_seconds") == [float(b) for b in
                                                                      defaults["monitoring_vllm_itl_buckets_ms"]]
    assert defaults["monitoring_slo_ttft_p95_ms"] in defaults["monitoring_vllm_ttft_buckets_ms"]
    assert defaults["monitoring_slo_itl_p95_ms"] in defaults["monitoring_vllm_itl_buckets_ms"]


def test_mount_point_of_picks_the_longest_mount_containing_the_path() -> None:
    mounts = ["/", "/var", "/var/lib/prometheus", "/models", "/var/lib/prom"]
    assert mount_point_of("/var/lib/prometheus/metrics2", mounts) == "/var/lib/prometheus"
    assert mount_point_of("/var/lib/prometheus2", mounts) == "/var"
    assert mount_point_of("/models/", mounts) == "/models"
    assert mount_point_of("/srv/x", []) == "/"


# ---------------------------------------------------------------- pages and dashboard


def grafana_expressions() -> list[str]:
    exprs = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            if node.get("type") == "query" and isinstance(node.get("query"), str):  # template variables
                exprs.append(node["query"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(GRAFANA.read_text()))
    return exprs


# A console page's PromQL: the quoted strings inside its template actions ({{ ... }}) that read like an
# expression (a name right before "(" or "{", or an aggregation's "by ("), not its labels, legends or render templates.
TEMPLATE_ACTION = re.compile(r"{{(.*?)}}")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
PROMQL_LIKE = re.compile(r"[\w:][({]|\b(?:by|without) \(")


def console_expressions(text: str) -> list[str]:
    return [html.unescape(q) for action in TEMPLATE_ACTION.findall(text) for q in QUOTED.findall(action)
            if PROMQL_LIKE.search(q)]


def as_checkable(expr: str) -> str:
    """Grafana's and the pages' placeholders as PromQL values, so promtool can parse the expression."""
    expr = re.sub(r"\$__rate_interval|\$__interval|\$\{?interval\}?", "5m", expr)
    expr = re.sub(r"\$\{?(\w+)\}?", "x", expr)
    return expr.replace("%s", "x")


def test_every_dashboard_expression_passes_promtool(tmp_path: Path) -> None:
    exprs = grafana_expressions() + [e for page in CONSOLE_SOURCES for e in console_expressions(page.read_text())]
    assert len(grafana_expressions()) >= 12 and len(exprs) > len(grafana_expressions()) + 10
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": as_checkable(e)}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = promtool("check", "rules", path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"{len(exprs)} expressions: {proc.stdout.strip()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CaptureHandler(http.server.BaseHTTPRequestHandler):
    """Serves the real vLLM's captured /metrics, as the unit would."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = VLLM_CAPTURE.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


# The Prometheus process of each URL the fixture below yields (a test sends it a reload).
RUNNING: dict[str, subprocess.Popen] = {}


@pytest.fixture(scope="module")
def prometheus(rules_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus 2.42 with the rendered rules and the role's console pages and libraries, scraping
    the captured vLLM /metrics as h1's gptoss-vllm.service and a dead port as its gptoss-vllm@1.service."""
    if not PROMETHEUS.exists():
        pytest.fail(f"{PROMETHEUS} missing: run `invoke promtool`")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CaptureHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    work = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(rules_dir / RULES_FILE)],
              "scrape_configs": [{"job_name": "vllm", "static_configs": [
                  {"targets": [f"127.0.0.1:{server.server_address[1]}"],
                   "labels": {"host": "h1", "unit": "gptoss-vllm.service"}},
                  {"targets": [f"127.0.0.1:{free_port()}"],
                   "labels": {"host": "h1", "unit": "gptoss-vllm@1.service"}}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "log").open("w")
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             f"--web.console.templates={ROLE / 'files' / 'consoles'}",
                             f"--web.console.libraries={CONSOLE_LIBRARIES}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    RUNNING[url] = proc
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"prometheus did not start: {(work / 'log').read_text()[-2000:]}")
                time.sleep(0.3)
        # Until both targets were scraped and the rules evaluated on them (and VllmDown went pending).
        while not (api(f"{url}/api/v1/query?query=host_unit:vllm_requests_running:sum")["result"]
                   and api(f"{url}/api/v1/alerts")["alerts"]):
            if time.monotonic() > deadline:
                pytest.fail(f"no rule evaluated on the scraped series: {(work / 'log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        server.shutdown()


def api(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())["data"]


def test_the_rules_evaluate_on_prometheus_against_the_real_vllm_metrics(prometheus: str) -> None:
    """Every rule loads and evaluates without error on the real exposition (its labels: engine,
    model_name); the vLLM figures are recorded and the dead unit's VllmDown is pending."""
    rules = [r for g in api(f"{prometheus}/api/v1/rules")["groups"] for r in g["rules"]]
    running = api(f"{prometheus}/api/v1/query?query=host_unit:vllm_requests_running:sum")["result"]
    alerts = api(f"{prometheus}/api/v1/alerts")["alerts"]
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert len(rules) >= 30
    assert [(s["metric"], s["value"][1]) for s in running] == [({"__name__": "host_unit:vllm_requests_running:sum",
                                                                  "host": "h1", "unit": "gptoss-vllm.service"}, "0")]
    assert [(a["labels"]["alertname"], a["labels"]["unit"], a["state"]) for a in alerts] == [
        ("VllmDown", "gptoss-vllm@1.service", "pending")]


def test_verify_reads_the_last_reload_live_from_the_server(prometheus: str, rules_dir: Path) -> None:
    """MON-002's "no reload pending" (service/host/monitoring_check.rules) on the real server. This one has
    no self-scrape job, so its TSDB holds no reload timestamp at all: the check must read it live from
    /metrics (a TSDB sample lags a scrape interval, and a copied data folder holds another instance's).
    A rule file written after the last reload is pending until the next one."""
    rule_file = str(rules_dir / RULES_FILE)
    assert monitoring_check.rules(prometheus, [rule_file], [], timeout=10)["reload_pending"] == []
    time.sleep(1.1)  # the server keeps whole seconds
    os.utime(rule_file)  # written after the last reload
    assert monitoring_check.rules(prometheus, [rule_file], [], timeout=10)["reload_pending"] == [rule_file]
    time.sleep(1.1)
    RUNNING[prometheus].send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while monitoring_check.rules(prometheus, [rule_file], [], timeout=10)["reload_pending"]:
        assert time.monotonic() < deadline, "the reload never cleared the pending rule file"
        time.sleep(0.5)


@pytest.mark.parametrize("page", [p.name for p in CONSOLES])
def test_console_page_renders_on_prometheus(prometheus: str, page: str) -> None:
    try:
        with urllib.request.urlopen(f"{prometheus}/consoles/{page}?host=h1", timeout=30) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{page}: HTTP {exc.code}: {exc.read().decode()[:2000]}")
    assert "error executing template" not in body and "<html" in body
    assert "PromConsole.Graph" in body
    # The real series reached the page: h1 is listed and its units-up figure is a number, not "-".
    assert re.search(r'href="gptoss.html\?host=h1"', body), body[:3000]
    assert re.search(r"sum%28up%7Bjob%3D%27vllm%27%2Chost%3D%27h1%27%7D%29[^>]*>\s*1\s*<", body), body[:6000]
