"""`pagedinfer operator` and `pagedinfer download`: flags, environment, and the real CLI process
running against kmock through a kubeconfig, serving /healthz and /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio.client import Configuration

from pagedinfer.engine.cli import build_parser as pagedinfer_parser
from pagedinfer.operator import resources as res
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.download import MARKER, DownloadError, download, is_complete
from pagedinfer.operator.k8s import KubeClient
from pagedinfer.operator.main import build_parser, config_from_args
from pagedinfer.operator.testing import Emulator, declare_resources, mock_server


def test_flags_override_environment():
    env = {
        "PAGEDINFER_OPERATOR_IMAGE_GPU": "reg/gpu:2",
        "PAGEDINFER_OPERATOR_NAMESPACES": "a, b",
        "PAGEDINFER_OPERATOR_RESYNC_SECONDS": "5",
        "PAGEDINFER_OPERATOR_ENABLE_STATS": "false",
    }
    base = OperatorConfig.from_env(env)
    assert base.image_gpu == "reg/gpu:2" and base.namespaces == ("a", "b")
    assert base.resync_seconds == 5.0 and not base.enable_stats
    cfg = config_from_args(build_parser().parse_args(["-n", "x", "--stats-seconds", "7"]), base)
    assert cfg.namespaces == ("x",) and cfg.stats_seconds == 7.0 and cfg.image_gpu == "reg/gpu:2"
    everywhere = config_from_args(build_parser().parse_args(["--all-namespaces"]), base)
    assert everywhere.namespaces == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "x", "-A"])


def test_registered_in_the_pagedinfer_cli():
    args = pagedinfer_parser().parse_args(["operator", "--standalone", "-n", "ml"])
    assert args.command == "operator" and args.namespace == ["ml"] and args.standalone
    args = pagedinfer_parser().parse_args(["download", "--model", "hf://a/b", "--dest", "/tmp/x"])
    assert args.command == "download"


def test_download_fetches_once_and_rejects_bad_uris(tmp_path: Path):
    calls = []

    def fetch(**kwargs):
        calls.append(kwargs)
        Path(kwargs["local_dir"], "config.json").write_text("{}")

    dest = tmp_path / "m"
    assert download("hf://org/name", dest, "v1", fetch=fetch)
    assert calls[0]["repo_id"] == "org/name" and calls[0]["revision"] == "v1"
    assert is_complete(dest, "hf://org/name", "v1") and (dest / MARKER).exists()
    assert not download("hf://org/name", dest, "v1", fetch=fetch)  # already there
    assert download("hf://org/name", dest, "v2", fetch=fetch)  # another revision is fetched
    assert len(calls) == 2
    assert not download("builtin://smollm2-135m", tmp_path / "b", fetch=fetch)
    for bad in ["pvc://claim/x", "s3://b/k", "hf://nope", "/abs/path"]:
        with pytest.raises(DownloadError):
            download(bad, tmp_path / "x", fetch=fetch)


def _kubeconfig(path: Path, server: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u", "namespace": "default"}}],
        "current-context": "kmock",
    }
    path.write_text(json.dumps(config))


@pytest.mark.timeout(120)
async def test_cli_process_reconciles_and_serves_health_and_metrics(tmp_path: Path, unused_tcp_port: int):
    async with Emulator() as server, mock_server(server):
        declare_resources(server, with_service_monitor=False)
        url = str(server.url).rstrip("/")
        _kubeconfig(tmp_path / "kubeconfig", url)
        env = dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig"), HOME=str(tmp_path))
        cmd = [sys.executable, "-m", "pagedinfer.operator.main", "--standalone", "--log-format", "plain"]
        cmd += ["--metrics-port", str(unused_tcp_port)]
        proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            for _ in range(600):
                if server.is_watching(res.INFERENCE_ENGINE.plural) and server.is_watching("deployments"):
                    break
                assert proc.returncode is None, (await proc.stdout.read()).decode()[-3000:]
                await asyncio.sleep(0.05)
            async with KubeClient(Configuration(host=url), keepalive=False) as client:
                body = {
                    "metadata": {"name": "smol", "namespace": "default"},
                    "spec": {"model": {"uri": "builtin://x"}},
                }
                await client.create(res.INFERENCE_ENGINE, body)
                for _ in range(400):
                    if await client.get(res.DEPLOYMENT, "default", "smol"):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("no Deployment from the CLI operator")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{unused_tcp_port}/healthz") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "ok"
                for _ in range(100):  # the counter moves when the reconcile returns, after its writes
                    async with http.get(f"http://127.0.0.1:{unused_tcp_port}/metrics") as resp:
                        text = await resp.text()
                    if 'pagedinfer_operator_reconcile_total{result="ok",trigger="spec"} 1.0' in text:
                        break
                    await asyncio.sleep(0.05)
            assert 'pagedinfer_operator_reconcile_total{result="ok",trigger="spec"} 1.0' in text
            assert "pagedinfer_operator_reconcile_duration_seconds_count" in text
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), timeout=30)
        assert proc.returncode in (0, -signal.SIGTERM)
