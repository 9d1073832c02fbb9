"""The Grafana dashboard's PromQL and the documented metric list (deploy/README.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "segserve.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "and", "or", "unless", "inf", "nan"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels of a collapsed row
    return out


def expressions(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query, template variable queries included."""
    out = [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        if var["type"] == "query":
            query = var["query"]
            out.append((f"${var['name']}", query["query"] if isinstance(query, dict) else query))
    return out


def concrete(expr: str) -> str:
    """The expression as Grafana would send it (variables substituted)."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "5m")
            .replace('"$instance"', '".*"'))


def metric_names(expr: str) -> set[str]:
    """Metric names an expression (or a label_values() query) reads."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,.*\)\s*", expr)
    if m:
        return {m.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range windows
    # grouping clauses go entirely, so that `sum by (le) (` reads as the call `sum (`
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for ident in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(?=\s*(\()?)", text):
        name, call = ident.group(0), ident.group(1)
        if call or name.lower() in _KEYWORDS or re.fullmatch(r"\d.*", name):
            continue
        names.add(name)
    return names


def documented_metrics() -> dict[str, tuple[str, bool]]:
    """{name: (type, exported today)} from the table between the markers in deploy/README.md."""
    text = (DEPLOY / "README.md").read_text()
    block = text.split("<!-- dashboard-metrics:begin -->", 1)[1].split(
        "<!-- dashboard-metrics:end -->", 1)[0]
    out = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = (cells[1], cells[3].startswith("yes"))
    return out


def allowed_names(documented: dict[str, tuple[str, bool]]) -> set[str]:
    names = set()
    for name, (kind, _) in documented.items():
        names.add(name)
        if kind == "histogram":
            names.update(name + s for s in _HISTOGRAM_SUFFIXES)
    return names
