"""The product as a user runs it: helm install the operator image, apply the CPU sample, talk to
the engine pods through their Service, scale, kill a pod, roll an update, uninstall.

The tests run in file order and share one operator and one engine (module fixtures): each step
builds on the one before, as a user's session does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import websockets
import yaml
from cluster_tools import ROOT, Cli, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(900)
NAME = "smollm2"
PROMPT = "What is the capital of France?"
# Two replicas plus a surge pod fit the 2-CPU node beside the operator (CPU is requested, not limited).
RESOURCES = {"cpu": "500m", "memory": "2Gi"}


@dataclass
class Engine:
    namespace: str
    operator_namespace: str
    cluster_ip: str = ""
    script_output: str = ""
    startup_phases: list[str] = field(default_factory=list)

    @property
    def http(self) -> str:
        return f"http://{self.cluster_ip}:8000"

    @property
    def grpc_target(self) -> str:
        return f"{self.cluster_ip}:50051"


def _engine_manifest(**overrides: Any) -> dict[str, Any]:
    """The CPU sample, sized so that two replicas and a surge pod fit the node."""
    sample = yaml.safe_load((ROOT / "manifests" / "samples" / "smollm2-cpu.yaml").read_text())
    sample["spec"]["resources"].update(RESOURCES)
    sample["spec"].update(overrides)
    return sample


def _pods(cli: Cli, namespace: str, name: str = NAME) -> list[dict[str, Any]]:
    return cli.items("pods", namespace, f"app.kubernetes.io/instance={name}")


def _is_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conds
    )


def _get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture(scope="module")
def deployed(cli: Cli, images: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """docker/cluster/local-node.sh as a user runs it (it waits for Ready and smoke-tests through
    a port-forward), with /startup polled on the side to see the loading phases."""
    suffix = uuid.uuid4().hex[:6]
    eng = Engine(f"pi-e2e-{suffix}", operator_namespace=f"pi-op-{suffix}")
    sample = tmp_path_factory.mktemp("e2e") / "sample.yaml"
    manifest = _engine_manifest()
    sample.write_text(yaml.safe_dump(manifest))
    env = {
        **cli.env,
        "PATH": f"{ROOT / '.tools' / 'bin'}:{os.environ['PATH']}",
        "NAMESPACE": eng.namespace,
        "OPERATOR_NAMESPACE": eng.operator_namespace,
        "SAMPLE": str(sample),
        "READY_TIMEOUT": "10m",
    }
    started = time.monotonic()
    script = subprocess.Popen(
        [
            str(ROOT / "docker" / "cluster" / "local-node.sh"),
            "--set",
            "operator.resyncSeconds=5",
            "--set",
            "operator.statsSeconds=5",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while script.poll() is None:
        _record_startup_phases(cli, eng)
        time.sleep(0.3)
    output = script.stdout.read()
    assert script.returncode == 0, output[-6000:]
    print(f"local-node.sh: {time.monotonic() - started:.1f} s; /startup phases seen: {eng.startup_phases}")
    eng.script_output = output
    eng.cluster_ip = cli.get("service", NAME, eng.namespace)["spec"]["clusterIP"]
    yield eng
    cli.kubectl("delete", "ie", "--all", "-n", eng.namespace, "--wait=true", "--timeout=120s", timeout=150)
    wait_for(lambda: not _pods(cli, eng.namespace), timeout=120)
    cli.helm("uninstall", "pagedinfer-operator", "-n", eng.operator_namespace, "--wait", "--timeout", "120s")
    # helm's --wait covers the objects it deleted, not the pods their controllers still stop
    wait_for(lambda: not _pods(cli, eng.operator_namespace, "pagedinfer-operator"), timeout=120)
    for namespace in (eng.namespace, eng.operator_namespace):
        leftovers = json.loads(cli.kubectl("get", "all", "-n", namespace, "-o", "json"))["items"]
        cli.kubectl("delete", "namespace", namespace, "--wait=false")
        assert leftovers == [], [f"{o['kind']}/{o['metadata']['name']}" for o in leftovers]


def _record_startup_phases(cli: Cli, eng: Engine) -> None:
    for pod in _pods(cli, eng.namespace) if cli.get("namespace", eng.namespace) else []:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        try:
            _, report = _get_json(f"http://{ip}:8000/startup", timeout=2)
        except OSError:
            continue
        phase = (report or {}).get("phase")
        if phase and (not eng.startup_phases or eng.startup_phases[-1] != phase):
            eng.startup_phases.append(phase)


def test_operator_pod_is_ready_without_a_403(cli: Cli, deployed: Engine):
    (pod,) = cli.items("pods", deployed.operator_namespace, "app.kubernetes.io/name=pagedinfer-operator")
    assert _is_ready(pod)
    logs = cli.kubectl("logs", pod["metadata"]["name"], "-n", deployed.operator_namespace)
    # (a word of its own: timestamps' microseconds may contain the digits)
    assert not re.search(r"\b403\b|forbidden", logs, re.IGNORECASE), logs[-3000:]


def test_engine_came_up_through_its_startup_phases(cli: Cli, deployed: Engine):
    phases = deployed.startup_phases
    assert phases and phases[-1] == "ready" and len(phases) >= 2, phases
    # The script's own smoke test went through a kubectl port-forward of the Service.
    assert "smoke: gRPC   -> " in deployed.script_output and "smoke: OpenAI -> " in deployed.script_output
    columns = cli.kubectl("get", "ie", NAME, "-n", deployed.namespace, "--no-headers").split()
    assert columns[1:5] == ["1/1", "Ready", "1", "smollm2-135m"], columns


def test_openai_sdk_through_the_service_matches_local_greedy(deployed: Engine):
    from pagedinfer.engine.config import DeviceConfig, EngineConfig, SchedulerConfig
    from pagedinfer.engine.llm import LLM
    from pagedinfer.engine.sampling_params import SamplingParams

    client = OpenAI(base_url=f"{deployed.http}/v1", api_key="none", timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0
    )
    served = reply.choices[0].message.content
    llm = LLM(EngineConfig(scheduler=SchedulerConfig(max_model_len=2048), device=DeviceConfig(device="cpu")))
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    (local,) = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=16, temperature=0.0)
    )
    assert served == local.text, (served, local.text)
    assert "Paris" in served


def test_grpc_health_and_streamed_generate(deployed: Engine):
    with grpc.insecure_channel(deployed.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
            sampling=pb.SamplingParams(max_tokens=12, temperature=0.0),
        )
        responses = list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=120))
    assert len(responses) > 2 and responses[-1].finished
    assert "Paris" in "".join(d.text for r in responses for d in r.deltas)


def test_websocket_page_and_metrics(deployed: Engine):
    with urllib.request.urlopen(f"{deployed.http}/", timeout=10) as resp:
        assert "<html" in resp.read().decode().lower()

    async def exchange() -> list[dict[str, Any]]:
        async with websockets.connect(f"ws://{deployed.cluster_ip}:8000/v1/ws") as ws:
            frames = [json.loads(await ws.recv())]
            await ws.send(json.dumps({"type": "generate", "id": "g1", "prompt": "Paris is", "max_tokens": 6}))
            while frames[-1]["type"] not in ("done", "error"):
                frames.append(json.loads(await ws.recv()))
            return frames

    frames = asyncio.run(exchange())
    assert frames[0]["type"] == "hello" and frames[-1]["type"] == "done", frames
    with urllib.request.urlopen(f"{deployed.http}/metrics", timeout=10) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    assert "pagedinfer_kv_cache_usage_ratio" in families
    assert any(s.value > 0 for s in families["pagedinfer_generation_tokens"].samples)


def _requests_served(pod_ip: str) -> float:
    with urllib.request.urlopen(f"http://{pod_ip}:8000/metrics", timeout=10) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    return sum(
        s.value for s in families["pagedinfer_requests"].samples if s.name == "pagedinfer_requests_total"
    )


def _chat(deployed: Engine, max_tokens: int = 4) -> str:
    client = OpenAI(base_url=f"{deployed.http}/v1", api_key="none", timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content


def test_scale_to_two_replicas_spreads_requests(cli: Cli, deployed: Engine):
    cli.kubectl("scale", f"ie/{NAME}", "--replicas=2", "-n", deployed.namespace)
    wait_for(lambda: sum(_is_ready(p) for p in _pods(cli, deployed.namespace)) == 2, timeout=600, interval=1)
    wait_for(
        lambda: cli.get("inferenceengine", NAME, deployed.namespace)["status"].get("ready") == "2/2",
        timeout=30,
    )
    ips = [p["status"]["podIP"] for p in _pods(cli, deployed.namespace)]
    before = {ip: _requests_served(ip) for ip in ips}
    for _ in range(24):
        _chat(deployed)
    served = {ip: _requests_served(ip) - before[ip] for ip in ips}
    assert sum(served.values()) == 24 and all(n > 0 for n in served.values()), served


class SteadyLoad:
    """Back-to-back chat requests through the Service on a thread; counts outcomes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _chat(self.engine)
                self.ok += 1
            except Exception as exc:  # every failure is counted and reported by the test
                self.failed.append(repr(exc))

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def test_deleted_pod_mid_stream_is_replaced_and_traffic_only_reaches_ready_pods(cli: Cli, deployed: Engine):
    client = OpenAI(base_url=f"{deployed.http}/v1", api_key="none", timeout=120, max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    first = next(iter(stream))
    assert first.choices[0].delta is not None
    victim = _pods(cli, deployed.namespace)[0]["metadata"]["name"]
    with SteadyLoad(deployed) as load:
        cli.kubectl("delete", "pod", victim, "-n", deployed.namespace, "--wait=false")
        chunks, error = 0, None
        try:
            for _chunk in stream:  # drained by the engine (preStop + SIGTERM drain) or cut cleanly
                chunks += 1
        except Exception as exc:  # a clean error is acceptable; a hang is not (the timeout bounds it)
            error = exc
        wait_for(
            lambda: (
                sum(_is_ready(p) for p in _pods(cli, deployed.namespace)) == 2
                and victim not in {p["metadata"]["name"] for p in _pods(cli, deployed.namespace)}
            ),
            timeout=600,
            interval=1,
        )
    print(
        f"stream after the delete: {chunks} chunks, error={error!r}; steady load ok={load.ok} failed={load.failed}"
    )
    assert load.ok > 0 and load.failed == [], load.failed


def test_rolling_update_fails_no_request(cli: Cli, deployed: Engine):
    old = {p["metadata"]["name"] for p in _pods(cli, deployed.namespace)}
    with SteadyLoad(deployed) as load:
        cli.kubectl(
            "patch",
            "ie",
            NAME,
            "-n",
            deployed.namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}}),
        )

        def rolled() -> bool:
            pods = _pods(cli, deployed.namespace)
            fresh = [p for p in pods if p["metadata"]["name"] not in old]
            return len(pods) == 2 and len(fresh) == 2 and all(_is_ready(p) for p in fresh)

        wait_for(rolled, timeout=900, interval=1)
    print(f"rolling update: {load.ok} requests succeeded, {len(load.failed)} failed")
    assert load.ok > 0 and load.failed == [], load.failed
    args = cli.get("deployment", NAME, deployed.namespace)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "8" in args[args.index("--max-num-seqs") + 1 :][:1], args


@pytest.mark.parametrize(
    ("case", "overrides", "reason", "words"),
    [
        (
            "missing-image",
            {"image": "localhost/pagedinfer/absent:1", "imagePullPolicy": "Never"},
            "ErrImageNeverPull",
            "absent:1",
        ),
        (
            "bad-model",
            {"model": {"uri": "builtin://no-such-model", "servedName": "x"}},
            "EngineFailed",
            "no-such-model",
        ),
    ],
)
def test_broken_engines_say_why_in_their_status(cli: Cli, deployed: Engine, case, overrides, reason, words):
    manifest = _engine_manifest(**overrides)
    manifest["metadata"].update(name=case, namespace=deployed.namespace)
    manifest["spec"]["replicas"] = 1
    cli.apply(manifest)

    def degraded() -> dict[str, Any] | None:
        status = (cli.get("inferenceengine", case, deployed.namespace) or {}).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        cond = conds.get("Degraded") or {}
        return cond if cond.get("status") == "True" and cond.get("reason") == reason else None

    try:
        cond = wait_for(degraded, timeout=300, interval=1)
        assert words in cond["message"], cond
    finally:  # a broken engine left behind would hold CPU the next case's pod needs
        cli.kubectl("delete", "ie", case, "-n", deployed.namespace, "--wait=false")
        wait_for(lambda: not _pods(cli, deployed.namespace, case), timeout=120)


def test_operator_never_restarted(cli: Cli, deployed: Engine):
    (pod,) = cli.items("pods", deployed.operator_namespace, "app.kubernetes.io/name=pagedinfer-operator")
    assert all(c["restartCount"] == 0 for c in pod["status"]["containerStatuses"])
