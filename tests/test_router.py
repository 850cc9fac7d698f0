"""The router's rules (module_utils/router_config.py), its module and the host-side launcher's refusals."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import run_ansible_module

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))
sys.path.insert(0, str(ROOT))

from ansible_collections.gptoss.host.plugins.module_utils import router_config  # noqa: E402

from service.venv import router_launch  # noqa: E402

ONE_BOX_TWO_GPUS = {"name": "box1", "address": "10.0.0.5", "port": 8000,
                    "instances": [{"name": "0", "port": 8001}, {"name": "1", "port": 8002}]}
PLAIN_HOST = {"name": "box2", "address": "10.0.0.6", "port": 8000, "instances": []}


def test_every_unit_of_every_host_is_a_worker_in_inventory_order():
    assert router_config.worker_urls([ONE_BOX_TWO_GPUS, PLAIN_HOST]) == [
        "http://10.0.0.5:8001", "http://10.0.0.5:8002", "http://10.0.0.6:8000"]
    assert router_config.worker_urls([{"name": "v6", "address": "fd00::1", "port": 8000}]) == ["http://[fd00::1]:8000"]


@pytest.mark.parametrize(("hosts", "message"), [
    ([], "no workers"),
    ([{"name": "a", "address": "", "port": 8000}], "host a: no address"),
    ([{"name": "a", "address": "bad host!", "port": 8000}], "neither an IP address nor a host name"),
    ([{"name": "a", "address": "10.0.0.1", "port": 70000}], "a: port 70000 is outside 1-65535"),
    ([{"name": "a", "address": "10.0.0.1", "port": "http"}], "a: port 'http' is not a number"),
    ([{"name": "a", "address": "10.0.0.1", "instances": [{"name": "0", "port": 8001}, {"name": "1", "port": 8001}]}],
     "a/1 and a/0 both serve http://10.0.0.1:8001"),
    ([{"name": "a", "address": "10.0.0.1", "port": 8000}, {"name": "b", "address": "10.0.0.1", "port": 8000}],
     "b and a both serve"),
    ([{"name": "far", "address": "127.0.0.1", "port": 8000, "remote": True}],
     "host far serves on 127.0.0.1, a loopback address, so the router on another host cannot reach it"),
])
def test_bad_worker_lists_are_refused(hosts, message):
    with pytest.raises(router_config.RouterConfigError, match=message):
        router_config.worker_urls(hosts)


def test_argv_has_policy_health_and_metrics_and_never_a_key():
    argv = router_config.router_argv({"host": "10.0.0.5", "port": 8100, "policy": "cache_aware",
                                      "health_check_interval_secs": 5, "health_failure_threshold": 2,
                                      "api_key": "must-not-appear"}, ["http://10.0.0.5:8001"])
    assert argv[:9] == ["--host", "10.0.0.5", "--port", "8100", "--policy", "cache_aware",
                        "--worker-urls", "http://10.0.0.5:8001", "--prometheus-host"]
    assert argv[argv.index("--prometheus-port") + 1] == "29000"  # always explicit: labs share addresses
    assert argv[argv.index("--health-check-interval-secs") + 1] == "5"
    assert argv[argv.index("--health-failure-threshold") + 1] == "2"
    assert not any("key" in a or "must-not-appear" in a for a in argv)


@pytest.mark.parametrize(("settings", "message"), [
    ({"policy": "fastest"}, "policy 'fastest' is not one of"),
    ({"health_check_interval_secs": 0}, "health_check_interval_secs: 0 is not a positive whole number"),
    ({"retry_max_retries": "3; rm -rf /"}, "retry_max_retries"),
    ({"port": 0}, "router: port 0 is outside"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(router_config.RouterConfigError, match=message):
        router_config.router_argv(settings, ["http://10.0.0.5:8001"])


def test_config_is_stable_and_compare_names_the_difference():
    first = router_config.render_config({}, [ONE_BOX_TWO_GPUS])
    assert first == router_config.render_config({}, [ONE_BOX_TWO_GPUS])
    assert json.loads(first)["workers"] == ["http://10.0.0.5:8001", "http://10.0.0.5:8002"]
    assert router_config.compare_workers(["http://a:1", "http://b:1"], ["http://b:1", "http://c:1"]) == {
        "missing": ["http://a:1"], "unexpected": ["http://c:1"]}


def test_launcher_refuses_a_key_in_the_config_and_broken_files(tmp_path, capsys):
    with_key = tmp_path / "key.json"
    with_key.write_text(json.dumps({"argv": ["--port", "8100", "--api-key", "x"]}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert router_launch.main([str(with_key), "--check"]) == 2
    assert "the key does not belong in the config" in capsys.readouterr().err
    assert router_launch.main([str(broken), "--check"]) == 2
    assert router_launch.main([str(tmp_path / "absent.json"), "--check"]) == 2


def run_module(args: dict) -> dict:
    """The real module through ansible (localhost, check mode): what the role gets back."""
    return run_ansible_module("router_config", args, "--check")


def test_module_returns_the_rule_and_refuses_bad_input():
    ok = run_module({"hosts": [ONE_BOX_TWO_GPUS], "settings": {"policy": "round_robin"}})
    assert ok["changed"] is False and ok["workers"] == ["http://10.0.0.5:8001", "http://10.0.0.5:8002"]
    assert ok["content"] == router_config.render_config({"policy": "round_robin"}, [ONE_BOX_TWO_GPUS])
    bad = run_module({"hosts": [], "settings": {}})
    assert bad["failed"] and "router_config: no workers" in bad["msg"]


def test_in_flight_reads_vllms_running_and_waiting_gauges():
    from ansible_collections.gptoss.host.plugins.module_utils import router_drain

    page = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0\n'
            'vllm:num_requests_running_total 99.0\n')
    assert router_drain.in_flight(page) == 3
    assert router_drain.in_flight("") == 0


def test_drain_against_a_router_that_does_not_answer_is_a_clear_error():
    from ansible_collections.gptoss.host.plugins.module_utils import router_drain

    # Nothing listening (the router not installed yet): nothing goes through it, nothing to drain.
    assert router_drain.take_out("http://127.0.0.1:9", "http://127.0.0.1:9", timeout_s=1)["router"] == "not running"
    # Something listening that is not a router: a clear error, before anything is changed.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(router_drain.DrainError, match=f"{url}/list_workers"):
            router_drain.take_out(url, "http://127.0.0.1:8001", timeout_s=1)
    finally:
        server.close()


class RouterAndWorker:
    """vllm-router's admin API (list/remove/add_worker) and one vLLM worker's /metrics, on one local
    HTTP server: a worker that keeps `running` requests in flight for as long as the test says."""

    def __init__(self, running: int | list[int]):
        import http.server
        import threading
        import urllib.parse

        owner = self
        self.running, self.workers, self.calls = running, [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, body: str, content_type: str = "application/json") -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/list_workers":
                    self.reply(json.dumps({"urls": owner.workers}))
                else:  # /metrics of the worker; a list is read one value per request, the last one kept
                    running = owner.running.pop(0) if isinstance(owner.running, list) and len(owner.running) > 1 \
                        else (owner.running[0] if isinstance(owner.running, list) else owner.running)
                    self.reply(f'vllm:num_requests_running{{engine="0"}} {running}.0\n'
                               'vllm:num_requests_waiting{engine="0"} 0.0\n', "text/plain")

            def do_POST(self) -> None:
                path, _, query = self.path.partition("?")
                url = urllib.parse.parse_qs(query)["url"][0]
                owner.calls.append(path)
                if path == "/remove_worker":
                    owner.workers.remove(url)
                else:
                    owner.workers.append(url)
                self.reply("{}")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.workers.append(self.url)  # the worker is this same server's /metrics
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("running", [0, 1])
def test_drain_policy_abort_puts_the_unit_back_and_proceed_reports_the_cut(running: int):
    from ansible_collections.gptoss.host.plugins.module_utils import router_drain

    fake = RouterAndWorker(running)
    try:
        if running:
            with pytest.raises(router_drain.DrainAborted, match=r"1 request\(s\) in flight after .* on_timeout=abort"
                                                                r".*back in the router") as aborted:
                router_drain.take_out(fake.url, fake.url, timeout_s=0.3, on_timeout="abort", poll_s=0.1)
            assert fake.workers == [fake.url] and fake.calls == ["/remove_worker", "/add_worker"]
            assert aborted.value.result["in_flight"] == 1 and aborted.value.result["drained"] is False
            fake.calls.clear()
        proceed = router_drain.take_out(fake.url, fake.url, timeout_s=0.3, on_timeout="proceed", poll_s=0.1)
        assert fake.workers == [] and fake.calls == ["/remove_worker"]  # out of the router until put_back
        assert proceed["in_flight"] == running and proceed["drained"] is (not running)
        assert proceed.get("cut", 0) == running
        summary = router_drain.describe(proceed)
        assert summary == (f"moved on with 1 request(s) in flight after {proceed['waited_s']} s (on_timeout=proceed: "
                           "the restart cut them)" if running else f"drained: 0 requests in flight after "
                                                                    f"{proceed['waited_s']} s")
        assert router_drain.put_back(fake.url, fake.url) == {"listed": True} and fake.workers == [fake.url]
        with pytest.raises(ValueError, match="on_timeout must be one of abort, proceed, not 'wait'"):
            router_drain.take_out(fake.url, fake.url, timeout_s=0, on_timeout="wait")
    finally:
        fake.close()


def test_one_read_of_zero_between_requests_is_not_a_drain():
    """A client that sends straight to the unit (the router's removal does not stop it) leaves a moment
    with 0 in flight between two of its requests: the drain must not take that moment as drained."""
    from ansible_collections.gptoss.host.plugins.module_utils import router_drain

    fake = RouterAndWorker([2, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    try:
        with pytest.raises(router_drain.DrainAborted, match=r"1 request\(s\) in flight after"):
            router_drain.take_out(fake.url, fake.url, timeout_s=0.5, on_timeout="abort", poll_s=0.05)
        assert fake.workers == [fake.url]  # back in the router
        fake.running = [1, 0, 0, 5]  # two reads of 0 in a row: drained, and the 5 after is never read
        result = router_drain.take_out(fake.url, fake.url, timeout_s=5, on_timeout="abort", poll_s=0.05)
        assert result["drained"] is True and result["in_flight"] == 0 and fake.running == [5]
        fake.running = [0, 3]  # a 0 read as the bound runs out (timeout 0) still wants its second read
        with pytest.raises(router_drain.DrainAborted, match=r"3 request\(s\) in flight after"):
            router_drain.take_out(fake.url, fake.url, timeout_s=0, on_timeout="abort", poll_s=0.05)
    finally:
        fake.close()


def test_vllm_change_refuses_an_unknown_drain_policy_before_anything():
    result = run_ansible_module("vllm_change", {
        "unit": "gptoss-test-none.service", "secrets_file": "/nonexistent/gptoss-secrets.env",
        "record_path": "/nonexistent/record.json", "files": [{"path": "/nonexistent/x", "content": "x"}],
        "record": {"base_url": "http://127.0.0.1:9"}, "lock_file": "/nonexistent/lock",
        "drain": {"router_url": "http://127.0.0.1:9", "worker_url": "http://127.0.0.1:9", "on_timeout": "wait"}})
    assert result["failed"] and result["msg"] == ("drain.on_timeout: 'wait' is not one of abort, proceed; "
                                                  "nothing was changed"), result


def test_a_serving_unit_that_an_earlier_failure_left_out_is_listed_again():
    from ansible_collections.gptoss.host.plugins.module_utils import router_drain

    fake = RouterAndWorker(0)
    try:
        fake.workers.clear()  # left out by an earlier failed change
        assert router_drain.ensure_listed(fake.url, fake.url) == {"listed": True, "added": True}
        assert fake.workers == [fake.url]
        assert router_drain.ensure_listed(fake.url, fake.url) == {"listed": True, "added": False}
        assert fake.calls == ["/add_worker"]  # once
    finally:
        fake.close()
    # The first converge: no router yet (it starts with every worker), nothing to add.
    assert router_drain.ensure_listed("http://127.0.0.1:9", "http://127.0.0.1:9") == {"listed": False,
                                                                                       "router": "not running"}
