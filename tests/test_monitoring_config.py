"""module_utils/monitoring_config.py: the scrape jobs, expected targets, receivers and refused inputs
(issue 25), and the filters the role uses, evaluated by ansible itself."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess

import pytest
from ansible_collections.gptoss.host.plugins.module_utils import monitoring_config as mc
from conftest import ROOT, VENV_BIN

SERVER = {"name": "gpu1", "prometheus": {"address": "127.0.0.1", "port": 9090},
          "alertmanager": {"address": "127.0.0.1", "port": 9093}, "blackbox": None}


def host(name="gpu1", remote=False, address="127.0.0.1", units=(("gptoss-vllm.service", 8000),), router=False):
    return {"name": name, "remote": remote,
            "vllm_units": [{"unit": u, "address": address, "port": p} for u, p in units],
            "router": {"address": address, "port": 29000} if router else None,
            "node": {"address": address, "port": 9100}, "gpu": {"address": address, "port": 9835}}


def test_single_host_jobs_labels_and_expected_targets():
    configs = mc.scrape_configs([host()], SERVER)
    assert [c["job_name"] for c in configs] == ["prometheus", "alertmanager", "vllm", "node", "gpu"]
    vllm = next(c for c in configs if c["job_name"] == "vllm")
    assert vllm["static_configs"] == [{"targets": ["127.0.0.1:8000"],
                                       "labels": {"host": "gpu1", "unit": "gptoss-vllm.service"}}]
    assert all(s["labels"]["host"] == "gpu1" for c in configs for s in c["static_configs"])
    assert mc.expected_targets(configs) == ["alertmanager 127.0.0.1:9093", "gpu 127.0.0.1:9835",
                                            "node 127.0.0.1:9100", "prometheus 127.0.0.1:9090",
                                            "vllm 127.0.0.1:8000"]


def test_replica_instances_each_a_target_with_its_unit_and_the_router():
    units = (("gptoss-vllm@0.service", 8001), ("gptoss-vllm@1.service", 8002))
    configs = mc.scrape_configs([host(units=units, router=True)], SERVER)
    vllm = next(c for c in configs if c["job_name"] == "vllm")
    assert [(s["targets"][0], s["labels"]["unit"]) for s in vllm["static_configs"]] == [
        ("127.0.0.1:8001", "gptoss-vllm@0.service"), ("127.0.0.1:8002", "gptoss-vllm@1.service")]
    assert next(c for c in configs if c["job_name"] == "router")["static_configs"][0]["targets"] == ["127.0.0.1:29000"]


def test_fleet_scrapes_every_host_and_refuses_a_loopback_exporter_elsewhere():
    configs = mc.scrape_configs([host(address="10.0.0.1"), host("gpu2", remote=True, address="10.0.0.2")], SERVER)
    node = next(c for c in configs if c["job_name"] == "node")
    assert [(s["targets"][0], s["labels"]["host"]) for s in node["static_configs"]] == [
        ("10.0.0.1:9100", "gpu1"), ("10.0.0.2:9100", "gpu2")]
    with pytest.raises(mc.MonitoringConfigError, match="gpu2 gptoss-vllm.service listens on loopback"):
        mc.scrape_configs([host(), host("gpu2", remote=True)], SERVER)


def test_a_bad_port_names_the_variable_it_came_from():
    """site.yml's first step renders the scrape targets before vllm_service's own validation: a port that is
    not a number must still name the variable the user set (test_bad_input's 'port not a number')."""
    bad = host()
    bad["vllm_units"][0].update(port="eighty", variable="vllm_service_port")
    with pytest.raises(mc.MonitoringConfigError, match="vllm_service_port: port 'eighty' is not a number"):
        mc.scrape_configs([bad], SERVER)


def test_blackbox_probes_health_through_the_proxy_and_names_the_instance_by_url():
    server = {**SERVER, "blackbox": {"address": "127.0.0.1", "port": 9115, "target": "https://10.0.0.1:8443/health"}}
    config = mc.prometheus_config([host()], server, {"scrape_interval": "15s", "evaluation_interval": "15s",
                                                      "rules_dir": "/etc/prometheus/rules"})
    probe = next(c for c in config["scrape_configs"] if c["job_name"] == "blackbox_health")
    assert probe["metrics_path"] == "/probe" and probe["params"] == {"module": ["http_2xx_tls"]}
    assert {"target_label": "__address__", "replacement": "127.0.0.1:9115"} in probe["relabel_configs"]
    assert "blackbox_health https://10.0.0.1:8443/health" in mc.expected_targets(config["scrape_configs"])
    assert config["rule_files"] == ["/etc/prometheus/rules/*.rules.yml"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]


def test_alertmanager_receivers_from_the_variables():
    base = {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"}
    config = mc.alertmanager_config({**base, "webhook_urls": ["http://127.0.0.1:9095/"], "email_to": "ops@x.invalid",
                                     "email_from": "gpu@x.invalid", "email_smarthost": "smtp.x.invalid:587",
                                     "email_username": "u", "email_password": "p"})
    receiver = config["receivers"][0]
    assert config["route"]["receiver"] == receiver["name"] == "gptoss"
    assert receiver["webhook_configs"] == [{"url": "http://127.0.0.1:9095/", "send_resolved": True}]
    assert receiver["email_configs"][0]["auth_password"] == "p" and receiver["email_configs"][0]["require_tls"]


GOOD = {"retention_time": "15d", "retention_size": "2GB", "scrape_interval": "15s", "evaluation_interval": "15s",
        "group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h", "storage_path": "/var/lib/prometheus/m",
        "model_mount_path": "/models", "model_mount_enabled": True, "webhook_urls": []}


@pytest.mark.parametrize(("change", "said"), [
    ({"retention_time": "15 days"}, "retention_time '15 days' is not a Prometheus duration"),
    ({"retention_size": "2G"}, "retention_size: '2G' is not a Prometheus size"),
    ({"storage_path": "/models/prometheus"}, "is on the model disk (/models)"),
    ({"storage_path": "relative/path"}, "is not an absolute path"),
    ({"email_to": "ops@x.invalid"}, "needs monitoring_alertmanager_email_from"),
    ({"webhook_urls": ["ftp://x"]}, "is not an http(s) URL"),
    ({"publish": True, "reverse_proxy_enabled": True, "publish_path": "/prometheus/", "publish_password": "short"},
     "monitoring_publish_password: 16+ characters"),
    ({"publish": True, "publish_password": "x" * 20, "publish_path": "/prometheus/"}, "needs the TLS proxy"),
])
def test_refused_inputs_say_why(change, said):
    found = mc.problems({**GOOD, **change})
    assert len(found) == 1 and said in found[0], found


def test_good_inputs_and_a_tsdb_beside_an_unmounted_model_disk_pass():
    assert mc.problems(GOOD) == []
    assert mc.problems({**GOOD, "storage_path": "/models/p", "model_mount_enabled": False}) == []
    assert mc.problems({**GOOD, "storage_path": "/modelsx/p"}) == []
    assert mc.size_bytes("512MB") == 512 * 2**20


def test_htpasswd_line_is_nginx_ssha_and_stable():
    line = mc.htpasswd_line("monitor", "a-long-vault-password")
    assert line == mc.htpasswd_line("monitor", "a-long-vault-password") and line.endswith("\n")
    user, _, hashed = line.strip().partition(":")
    raw = base64.b64decode(hashed.removeprefix("{SSHA}"))
    assert user == "monitor" and hashlib.sha1(b"a-long-vault-password" + raw[20:]).digest() == raw[:20]
    with pytest.raises(mc.MonitoringConfigError):
        mc.htpasswd_line("a:b", "x")


def test_the_filters_run_through_ansible():
    expr = ("{{ {'retention_time': 'bad'} | gptoss.host.monitoring_problems | length > 0 }}|"
            "{{ 'password-0123456789' | gptoss.host.htpasswd_line('monitor') | regex_search('^monitor:[{]SSHA[}]') }}")
    proc = subprocess.run([str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local", "-m",
                           "ansible.builtin.debug", "-a", json.dumps({"msg": expr})], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
                                                       "PATH": "/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1"})
    assert "True|monitor:{SSHA}" in proc.stdout, proc.stdout + proc.stderr
