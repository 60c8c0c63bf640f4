"""The Grafana dashboard and the PrometheusRule alerts query only what the code exports.

Every PromQL expression is parsed with a real PromQL parser (promql-parser); the metric names
it selects must be series the engine (`pagedinfer.engine.metrics.ServingMetrics`) or the
operator (`pagedinfer.operator.metrics.OperatorMetrics`) registers, and the labels it filters
or groups on must be ones those series carry or Prometheus adds to every scraped target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagedinfer-operator"
DASHBOARD = CHART / "dashboards" / "pagedinfer.json"
# Series Prometheus itself adds for every target (used by the "down" alerts).
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus attaches from the target (Prometheus Operator monitors) and histogram `le`.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint", "le"}
# Grafana's built-in and dashboard variables, replaced by values PromQL accepts.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _series(registry) -> dict[str, set[str]]:
    """Exposed series name -> its labels, from a prometheus_client registry (types applied)."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = set().union(*(s.labels.keys() for s in family.samples)) if family.samples else set()
        labels |= set(getattr(family, "_labelnames", ()))
        if family.type == "counter":
            names = [family.name + "_total"]
        elif family.type == "histogram":
            names = [family.name + suffix for suffix in ("_bucket", "_sum", "_count")]
        elif family.type == "summary":
            names = [family.name, family.name + "_sum", family.name + "_count"]
        else:
            names = [family.name]
        for name in names:
            out[name] = labels - {"le"} if not name.endswith("_bucket") else labels | {"le"}
    return out


def _label_names(registry) -> dict[str, set[str]]:
    """Labels declared on each collector (labelled metrics with no sample yet show none)."""
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):  # prometheus_client keeps them here
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            for name in registry._collector_to_names[collector]:
                out[name] = set(names)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    from pagedinfer.engine import metrics as engine_metrics
    from pagedinfer.operator.metrics import OperatorMetrics

    serving = engine_metrics.ServingMetrics("m", enable_vllm_metrics=True)
    serving.attach_engine(lambda: {}, lambda: True)
    series: dict[str, set[str]] = {}
    for registry in (serving.registry, OperatorMetrics().registry):
        declared = _label_names(registry)
        for name, labels in _series(registry).items():
            series[name] = labels | declared.get(name, set())
    # The engine's own list of names agrees with what its registry exports.
    for name in engine_metrics.METRIC_NAMES:
        assert name in series or f"{name}_bucket" in series, name
    return series


def _parse(expr: str) -> pq.Expr:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    expr = re.sub(r"\$\{?(\w+)\}?", "x", expr)  # $namespace / ${pod} inside label matchers
    return pq.parse(expr)


def _selectors(expr: pq.Expr) -> tuple[list[pq.VectorSelector], set[str]]:
    """Vector selectors, and every label named in by/on/without/ignoring clauses."""
    selectors: list[pq.VectorSelector] = []
    grouping: set[str] = set()

    def visit(node: pq.Expr) -> None:
        if isinstance(node, pq.VectorSelector):
            selectors.append(node)
        if isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        if isinstance(node, pq.BinaryExpr) and node.modifier is not None and node.modifier.matching:
            grouping.update(node.modifier.matching.labels)

    pq.walk(expr, visit)
    return selectors, grouping


def _check(expr: str, exported: dict[str, set[str]]) -> set[str]:
    """Asserts `expr` queries only exported names and labels; returns the names it uses."""
    selectors, grouping = _selectors(_parse(expr))
    assert selectors, f"no metric in {expr!r}"
    used = set()
    for sel in selectors:
        assert sel.name, f"selector without a metric name in {expr!r}"
        assert sel.name in exported or sel.name in PROMETHEUS_SERIES, f"{sel.name} is not exported ({expr!r})"
        allowed = exported.get(sel.name, set()) | TARGET_LABELS
        for matcher in sel.matchers.matchers:
            assert matcher.name in allowed, f"{sel.name} has no label {matcher.name} ({expr!r})"
        used.add(sel.name)
    metric_labels = set().union(*(exported.get(s.name, set()) for s in selectors))
    assert grouping <= metric_labels | TARGET_LABELS, f"unknown labels {grouping} in {expr!r}"
    return used


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_metrics(exported):
    used = set()
    for target in _targets(_dashboard()):
        used |= _check(target["expr"], exported)
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"]["query"])
            assert inner, var["query"]
            _check(inner.group(1), exported)
            assert inner.group(2) in TARGET_LABELS | exported[_selectors(_parse(inner.group(1)))[0][0].name]
    # Everything the issue asks the dashboard to show is on it.
    required = {
        "pagedinfer_requests_total",
        "pagedinfer_time_to_first_token_seconds_bucket",
        "pagedinfer_inter_token_latency_seconds_bucket",
        "pagedinfer_generation_tokens_total",
        "pagedinfer_num_requests_running",
        "pagedinfer_num_requests_waiting",
        "pagedinfer_kv_cache_usage_ratio",
        "pagedinfer_kv_cache_fragmentation_ratio",
        "pagedinfer_prefix_cache_hit_ratio",
        "pagedinfer_spec_decode_acceptance_ratio",
    }
    assert required <= used, f"dashboard lacks {required - used}"


def test_dashboard_structure():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    per_pod = [t for t in _targets(dash) if "pod" in _selectors(_parse(t["expr"]))[1]]
    assert len(per_pod) >= 20, "series are broken down per pod"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace", "model", "pod"}


@pytest.fixture(scope="module")
def rules(helm) -> dict[str, dict[str, Any]]:
    values = {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}
    objs = helm.template(CHART, values)
    rule_obj = next(o for o in objs if o["kind"] == "PrometheusRule")
    return {r["alert"]: r for g in rule_obj["spec"]["groups"] for r in g["rules"]}


def test_alerts_query_only_exported_metrics(rules, exported):
    for rule in rules.values():
        _check(rule["expr"], exported)
        assert pq.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


EXPECTED_ALERTS = {
    "PagedInferEngineDown": "up",
    "PagedInferTTFTHigh": "pagedinfer_time_to_first_token_seconds_bucket",
    "PagedInferKVCacheFull": "pagedinfer_kv_cache_usage_ratio",
    "PagedInferPreemptionRateHigh": "pagedinfer_preemptions_total",
    "PagedInferErrorRateHigh": "pagedinfer_requests_total",
    "PagedInferOperatorReconcileErrors": "pagedinfer_operator_reconcile_errors_total",
    "PagedInferOperatorDown": "up",
}


def test_every_required_alert_exists(rules):
    assert set(rules) == set(EXPECTED_ALERTS)
    for name, metric in EXPECTED_ALERTS.items():
        assert metric in {s.name for s in _selectors(_parse(rules[name]["expr"]))[0]}, name
    assert rules["PagedInferKVCacheFull"]["for"] == "5m"
    assert re.search(r">\s*0\.95\b", rules["PagedInferKVCacheFull"]["expr"])
    assert 'finish_reason="error"' in rules["PagedInferErrorRateHigh"]["expr"]


def test_error_alert_matches_the_engines_finish_reason():
    from pagedinfer.engine.outputs import FinishReason

    assert FinishReason.ERROR.value == "error"


def test_alert_thresholds_and_toggles_come_from_values(helm):
    values = {
        "prometheusRule": {
            "enabled": True,
            "engineTargetSelector": 'job="my-engines"',
            "rules": {
                "ttftHigh": {"thresholdSeconds": 0.75, "for": "3m"},
                "preemptionRateHigh": {"enabled": False},
            },
        }
    }
    objs = helm.template(CHART, values)
    rule_obj = next(o for o in objs if o["kind"] == "PrometheusRule")
    by_name = {r["alert"]: r for g in rule_obj["spec"]["groups"] for r in g["rules"]}
    assert "PagedInferPreemptionRateHigh" not in by_name
    assert "PagedInferOperatorDown" not in by_name  # no ServiceMonitor, nothing scrapes the operator
    assert (
        re.search(r">\s*0\.75\s*$", by_name["PagedInferTTFTHigh"]["expr"])
        and by_name["PagedInferTTFTHigh"]["for"] == "3m"
    )
    engine_down = _selectors(_parse(by_name["PagedInferEngineDown"]["expr"]))[0][0]
    assert [(m.name, m.value) for m in engine_down.matchers.matchers] == [("job", "my-engines")]


def test_engine_down_alert_targets_the_pod_monitor_job(helm):
    objs = helm.template(CHART, {"prometheusRule": {"enabled": True}, "engineMonitor": {"enabled": True}})
    monitor = next(o for o in objs if o["kind"] == "PodMonitor")
    rule_obj = next(o for o in objs if o["kind"] == "PrometheusRule")
    down = next(
        r for g in rule_obj["spec"]["groups"] for r in g["rules"] if r["alert"] == "PagedInferEngineDown"
    )
    job = (
        f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"  # Prometheus Operator's job label
    )
    matchers = _selectors(_parse(down["expr"]))[0][0].matchers.matchers
    assert [(m.name, m.value) for m in matchers] == [("job", job)]


def test_engine_down_alert_without_pod_monitor_matches_the_operators_engine_targets(rules):
    """Without the PodMonitor, engines are scraped through the operator's per-engine
    ServiceMonitors: the alert matches the engine container and its `http` port."""
    from pagedinfer.operator.builders.deployment import CONTAINER

    down = _selectors(_parse(rules["PagedInferEngineDown"]["expr"]))[0][0]
    assert sorted((m.name, m.value) for m in down.matchers.matchers) == [
        ("container", CONTAINER),
        ("endpoint", "http"),
    ]
