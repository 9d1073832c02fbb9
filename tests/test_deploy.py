"""deploy/: the Grafana dashboard is valid JSON whose PromQL reads only documented metric
names; the Prometheus, Grafana provisioning and compose files hang together."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy_support import (
    DASHBOARD,
    DEPLOY,
    allowed_names,
    documented_metrics,
    expressions,
    load_dashboard,
    metric_names,
    panels,
)

PANELS = ("time to first token", "inter-token latency", "tokens/s", "running / waiting",
          "admission decisions", "memory by tier", "segments", "bank hit ratio", "507")


def test_dashboard_parses_and_has_the_panels_operators_expect() -> None:
    dash = load_dashboard()
    assert dash["uid"] == "segserve" and dash["panels"]
    titles = [p["title"].lower() for p in panels(dash)]
    for wanted in PANELS:
        assert any(wanted in t for t in titles), wanted
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]


def test_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for p in panels(load_dashboard()):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, (p["title"], taken.get((x, y)))
                taken[(x, y)] = p["title"]


def test_every_expression_reads_only_documented_metrics() -> None:
    documented = documented_metrics()
    assert len(documented) >= 20
    allowed = allowed_names(documented)
    used: set[str] = set()
    for title, expr in expressions(load_dashboard()):
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= allowed, (title, sorted(names - allowed))
        used |= names
    # and the list holds nothing the dashboard does not use
    unused = {n for n in documented if not any(u == n or u.startswith(n + "_") for u in used)}
    assert not unused


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (le) (rate(a_bucket{instance=~"$instance",le="+Inf"}[$__rate_interval]))',
         {"a_bucket"}),
        ("sum(x) or sum(y_total) unless on() count(z)", {"x", "y_total", "z"}),
        ('sum(increase(r_total{status="507"}[$__range])) or vector(0)', {"r_total"}),
        ("histogram_quantile(0.99, sum by (le, kind) (rate(h_bucket[1m])))", {"h_bucket"}),
        ("label_values(segserve_requests_total, instance)", {"segserve_requests_total"}),
    ],
)
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_prometheus_config_scrapes_segserve() -> None:
    yaml = pytest.importorskip("yaml")
    cfg: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "segserve"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["segserve:8000"]


def test_compose_and_provisioning_point_at_files_that_exist() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"segserve", "prometheus", "grafana"}
    assert (DEPLOY / services["segserve"]["build"]["context"]
            / services["segserve"]["build"]["dockerfile"]).is_file()
    for svc in services.values():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), port  # loopback only
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), src
    graf = [v.split(":")[:2] for v in services["grafana"]["volumes"]]
    dash_mount = next(dst for src, dst in graf if src == "./grafana/dashboards")
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/segserve.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == dash_mount
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert DASHBOARD.parent.name == "dashboards"
