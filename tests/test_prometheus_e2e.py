"""A real Prometheus scrapes a running segserve (tiny random model) and answers queries.

Skipped only where the `prometheus` binary is absent (`make test` installs Debian's
package where it runs as root with apt). Prometheus gets a generated configuration with
the scrape job of deploy/prometheus/prometheus.yml pointed at the test server; the test
waits for a scrape, reads segserve series back through `/api/v1/query`, and has
Prometheus evaluate every expression of the Grafana dashboard.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy_support import DEPLOY, concrete, expressions, load_dashboard
from tests.http_support import free_port
from tests.process_support import ServerProcess, write_tiny_model_dir

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def segserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("prom-segserve")
    model = write_tiny_model_dir(tmp / "model")
    srv = ServerProcess(tmp / "server.log", "--model", str(model), "--bank-dir", "none")
    try:
        srv.wait_healthy(120)
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            history = [{"role": "user", "content": "hello there, how are you"}]
            for _ in range(2):  # two turns of one conversation: the second reuses the first
                r = c.post("/v1/chat/completions",
                           json={"model": "default", "messages": history, "max_tokens": 4})
                assert r.status_code == 200, r.text
                history += [r.json()["choices"][0]["message"],
                            {"role": "user", "content": "and then?"}]
        yield srv
    finally:
        srv.kill()


class Prometheus:
    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        # The deploy/ job, scraping every second, pointed at the test server.
        job = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
        job = job.replace("segserve:8000", target).replace("scrape_interval: 5s",
                                                           "scrape_interval: 1s")
        config.write_text(job)
        self.log_path = tmp / "prometheus.log"
        assert PROMETHEUS is not None
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        self.client = httpx.Client(base_url=self.url, timeout=10, trust_env=False)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]

    def query(self, expr: str) -> dict[str, Any]:
        r = self.client.get("/api/v1/query", params={"query": expr})
        body: dict[str, Any] = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        data: dict[str, Any] = body["data"]
        return data

    def wait_for(self, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "prometheus exited:\n" + self.log()
            try:
                result = self.query(expr)["result"]
                if result:
                    return list(result)
            except (httpx.HTTPError, ValueError):
                pass  # not listening yet
            assert time.monotonic() < deadline, f"no {expr!r} after {timeout}s:\n" + self.log()
            time.sleep(0.5)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def prometheus(segserve: ServerProcess,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{segserve.port}")
    try:
        prom.wait_for('up{job="segserve"} == 1')
        yield prom
    finally:
        prom.stop()


def test_prometheus_scrapes_segserve_series(prometheus: Prometheus) -> None:
    chat = prometheus.wait_for(
        'segserve_requests_total{job="segserve",endpoint="/v1/chat/completions",status="200"}'
    )
    assert float(chat[0]["value"][1]) >= 2
    ttft = prometheus.wait_for("segserve_time_to_first_token_seconds_count")
    assert float(ttft[0]["value"][1]) >= 2
    names = prometheus.client.get("/api/v1/label/__name__/values").json()["data"]
    assert {"segserve_kv_segments", "segserve_requests_total"} <= set(names)


def test_prometheus_evaluates_every_dashboard_expression(
    prometheus: Prometheus, segserve: ServerProcess
) -> None:
    # one more request while Prometheus watches, so that rates and quantiles have data
    body = {"model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": "one more, please"}]}
    r = httpx.post(segserve.url + "/v1/chat/completions", json=body, timeout=120,
                   trust_env=False)
    assert r.status_code == 200, r.text
    prometheus.wait_for("increase(segserve_time_to_first_token_seconds_count[1m]) > 0")
    for _title, expr in expressions(load_dashboard()):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        prometheus.query(concrete(expr))  # asserts Prometheus accepted it
    ttft = prometheus.query(
        "histogram_quantile(0.5, sum by (le) (increase("
        "segserve_time_to_first_token_seconds_bucket[1m])))")["result"]
    assert ttft and float(ttft[0]["value"][1]) > 0


def test_promtool_accepts_the_deploy_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool")
    run = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
