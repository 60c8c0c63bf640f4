"""docker/docker-compose.yml: the CPU engine, Prometheus scraping it, Grafana with the chart's
dashboard provisioned; every file it mounts exists and the pieces point at each other."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def _mounts(service: dict) -> dict[str, Path]:
    """container path -> host path (resolved against docker/, where the compose file lives)."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        out[container] = (DOCKER / host).resolve()
    return out


def test_services_and_pinned_images(compose):
    services = compose["services"]
    assert set(services) == {"engine", "prometheus", "grafana"}
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (name, image)
        assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"]


def test_engine_service_builds_the_cpu_image_and_runs_the_cli(compose):
    from pagedinfer.engine.cli import build_parser

    engine = compose["services"]["engine"]
    build = engine["build"]
    assert (DOCKER / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).is_file()
    assert build["args"]["EMBED_MODEL"] == "1"
    args = build_parser().parse_args(engine["command"])
    assert (args.command, args.device, args.host) == ("serve", "cpu", "0.0.0.0")
    ports = {p.split(":")[1] for p in engine["ports"]}
    assert ports == {str(args.http_port), str(args.grpc_port)}
    assert engine["user"].split(":")[0] != "0" and engine["read_only"] is True
    assert "/tmp" in engine["tmpfs"]  # HOME and caches live there on a read-only root


def test_every_mounted_file_exists(compose):
    for name, svc in compose["services"].items():
        for container, host in _mounts(svc).items():
            assert host.exists(), f"{name}: {host} (for {container}) is missing"


def test_prometheus_scrapes_the_engine(compose):
    from pagedinfer.engine.cli import build_parser

    prom = compose["services"]["prometheus"]
    config_path = _mounts(prom)["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    assert f"--config.file={'/etc/prometheus/prometheus.yml'}" in prom["command"]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (static,) = job["static_configs"]
    http_port = build_parser().parse_args(compose["services"]["engine"]["command"]).http_port
    assert static["targets"] == [f"engine:{http_port}"]
    # The dashboard filters on these (Kubernetes adds them; here they are static).
    assert {"namespace", "pod"} <= set(static["labels"])


def test_grafana_provisions_prometheus_and_the_charts_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    prom_port = compose["services"]["prometheus"]["ports"][0].split(":")[1]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == f"http://prometheus:{prom_port}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pagedinfer.yml").read_text())["providers"]
    dashboards = [c for c, h in mounts.items() if h.suffix == ".json"]
    assert dashboards and all(str(PurePosixPath(c).parent) == provider["options"]["path"] for c in dashboards)
    chart_dashboard = (ROOT / "charts" / "pagedinfer-operator" / "dashboards" / "pagedinfer.json").resolve()
    assert mounts[dashboards[0]] == chart_dashboard  # one dashboard for Helm and compose
    dash = json.loads(chart_dashboard.read_text())
    source_var = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert source_var["query"] == datasource["type"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboards[0]
