"""Operator benchmark against the kmock API: creation latency, throughput with many CRs, and API
writes per no-op reconcile, side by side with a blind-apply reconcile (the peer-operator habit of
patching every owned object on every pass) and with the mock API's own request rate (the limit).

    .venv/bin/python bench/operator_reconcile.py [--engines 200] [--latency-samples 20]

Writes bench/results/operator.json and bench/results/operator.png and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import Configuration

from pagedinfer.operator import resources as res
from pagedinfer.operator.apply import with_last_applied
from pagedinfer.operator.builders.deployment import RenderInput
from pagedinfer.operator.builders.desired import desired_state
from pagedinfer.operator.builders.meta import EngineRef, model_cache_name
from pagedinfer.operator.k8s import KubeClient
from pagedinfer.operator.reconcile import OperatorContext, parse_spec, reconcile
from pagedinfer.operator.testing import (
    Emulator,
    declare_resources,
    mock_server,
    running_operator,
    test_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

RESULTS = Path(__file__).resolve().parent / "results"
NAMESPACE = "bench"
SPEC = {
    "model": {"uri": "builtin://smollm2-135m"},
    "replicas": 2,
    "modelCache": {"size": "1Gi"},
}
OWNED_PER_ENGINE = 4  # PVC, Service, Deployment, PDB for SPEC


def cr(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pagedinfer.io/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": SPEC,
    }


def live(server: Emulator, resource: res.Resource, name: str) -> dict[str, Any] | None:
    key = (server_resource(resource), NAMESPACE, name)
    if key not in server.objects or server.objects[key].deleted:
        return None
    return dict(server.objects[key].raw)


def server_resource(resource: res.Resource) -> Any:
    import kmock

    return kmock.resource(resource.group, resource.version, resource.plural)


def is_rendered(server: Emulator, name: str) -> bool:
    wanted = [(res.PVC, model_cache_name(EngineRef(name, NAMESPACE, ""))), (res.SERVICE, name)]
    wanted += [(res.DEPLOYMENT, name), (res.PDB, name)]
    if not all(live(server, r, n) for r, n in wanted):
        return False
    status = (live(server, res.INFERENCE_ENGINE, name) or {}).get("status") or {}
    return status.get("observedGeneration") == 1


async def wait_until(predicate: Any, timeout: float) -> float:
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.002)
    return time.perf_counter() - start


async def api_get_rate(client: KubeClient, n: int = 400, concurrency: int = 8) -> float:
    """The limit: GETs per second the mock API serves to one client (the reads a reconcile makes)."""
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await client.get(res.SERVICE, NAMESPACE, "lat-0")

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - start)


async def creation_latency(server: Emulator, client: KubeClient, samples: int) -> list[float]:
    """Seconds from the CR's POST until every owned object exists and status is written (idle operator)."""
    out = []
    for i in range(samples):
        start = time.perf_counter()
        await client.create(res.INFERENCE_ENGINE, cr(f"lat-{i}"))
        await wait_until(lambda i=i: is_rendered(server, f"lat-{i}"), timeout=30)
        out.append(time.perf_counter() - start)
    return out


async def bulk_create(server: Emulator, client: KubeClient, n: int) -> float:
    """Seconds until n CRs created at once are all fully rendered."""
    start = time.perf_counter()
    await asyncio.gather(*(client.create(res.INFERENCE_ENGINE, cr(f"ie-{i}")) for i in range(n)))
    await wait_until(lambda: all(is_rendered(server, f"ie-{i}") for i in range(n)), timeout=600)
    return time.perf_counter() - start


async def noop_pass(server: Emulator, ctx: OperatorContext, names: list[str]) -> dict[str, float]:
    """One full reconcile of every CR with nothing to change: writes counted at the API."""
    bodies = [live(server, res.INFERENCE_ENGINE, n) for n in names]
    writes_before, reads_before = server.num_writes, ctx.client.calls["GET"]
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(reconcile(ctx, b, "bench") for b in bodies))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "reconciles_per_second": len(names) / seconds,
        "api_writes_per_reconcile": (server.num_writes - writes_before) / len(names),
        "reported_writes": sum(o.num_writes for o in outcomes),
        "api_reads_per_reconcile": (ctx.client.calls["GET"] - reads_before) / len(names),
    }


async def blind_apply_pass(server: Emulator, client: KubeClient, names: list[str]) -> dict[str, float]:
    """The peer habit: PATCH every owned object and the status on every pass, changed or not."""
    writes_before = server.num_writes
    start = time.perf_counter()
    slots = asyncio.Semaphore(test_config().max_concurrent_reconciles)  # same concurrency as ours

    async def one(name: str) -> None:
        async with slots:
            await blind_reconcile(name)

    async def blind_reconcile(name: str) -> None:
        body = live(server, res.INFERENCE_ENGINE, name)
        ref = EngineRef.from_body(body)
        inp = RenderInput(ref, parse_spec(body), test_config())
        for item in desired_state(inp):
            if item.body is not None:
                await client.patch(item.resource, NAMESPACE, item.name, with_last_applied(item.body))
        await client.patch(
            res.INFERENCE_ENGINE, NAMESPACE, name, {"status": body["status"]}, subresource="status"
        )

    await asyncio.gather(*(one(n) for n in names))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "reconciles_per_second": len(names) / seconds,
        "api_writes_per_reconcile": (server.num_writes - writes_before) / len(names),
    }


async def timer_window(server: Emulator, memo: Any, seconds: float) -> dict[str, float]:
    """Writes while the operator's own resync timer reconciles everything (Kopf's writes included)."""
    counter = memo.ctx.metrics.reconciles
    before_n = sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    before_w = server.num_writes
    await asyncio.sleep(seconds)
    after_n = sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    reconciles = after_n - before_n
    writes = server.num_writes - before_w
    return {
        "reconciles": reconciles,
        "api_writes": writes,
        "api_writes_per_reconcile": writes / max(reconciles, 1),
    }


async def run(engines: int, samples: int) -> dict[str, Any]:
    async with Emulator() as server, mock_server(server):
        declare_resources(server, with_service_monitor=False)
        server.namespaces.add(NAMESPACE)
        configuration = Configuration(host=str(server.url).rstrip("/"))
        async with KubeClient(configuration, keepalive=False) as client:
            await client.request("GET", "/version")
            async with running_operator(configuration, test_config(), server=server) as memo:
                latency = await creation_latency(server, client, samples)
                get_rate = await api_get_rate(client)
                bulk_seconds = await bulk_create(server, client, engines)
                await asyncio.sleep(2.0)  # the watch events of the operator's own writes settle
                names = [f"ie-{i}" for i in range(engines)]
                ours = await noop_pass(server, memo.ctx, names)
                blind = await blind_apply_pass(server, client, names)
                await asyncio.sleep(2.0)
                ours_after_blind = await noop_pass(server, memo.ctx, names)
            # A second operator process-equivalent with a fast timer: resume, then idle resyncs.
            total = engines + samples
            async with running_operator(
                configuration, test_config(resync_seconds=5.0), server=server
            ) as memo2:
                await asyncio.sleep(3.0)  # resume handlers of every CR
                timer = await timer_window(server, memo2, 11.0)
                timer["engines"] = total
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "api": "kmock 0.8 in-process (KubernetesEmulator + pagedinfer.operator.testing.Emulator)",
        "engines": engines,
        "owned_objects_per_engine": OWNED_PER_ENGINE,
        "creation_latency_seconds": {
            "samples": latency,
            "p50": statistics.median(latency),
            "p95": sorted(latency)[max(0, int(0.95 * len(latency)) - 1)],
        },
        "bulk_create": {
            "seconds": bulk_seconds,
            "engines_per_second": engines / bulk_seconds,
            "objects_per_second": engines * OWNED_PER_ENGINE / bulk_seconds,
        },
        "api_get_per_second_limit": get_rate,
        "noop_reconcile": ours,
        "noop_reconcile_after_blind_pass": ours_after_blind,
        "blind_apply_peer": blind,
        "timer_driven_noop": timer,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    drawn = common.subplots(path, 1, 3, figsize=(15, 4.2))
    if drawn is None:
        return
    fig, axes = drawn
    lat = [1000 * s for s in result["creation_latency_seconds"]["samples"]]
    axes[0].hist(lat, bins=15, color="tab:blue")
    axes[0].set_title("CR created -> all owned objects + status")
    axes[0].set_xlabel("ms")
    ours, blind = result["noop_reconcile"], result["blind_apply_peer"]
    limit = result["api_get_per_second_limit"] / max(ours["api_reads_per_reconcile"], 1)
    bars = {"ours (no-op)": ours["reconciles_per_second"], "blind apply": blind["reconciles_per_second"]}
    bars["API read limit"] = limit
    axes[1].bar(list(bars), list(bars.values()), color=["tab:blue", "tab:orange", "tab:gray"])
    axes[1].set_title(f"Reconciles/s over {result['engines']} engines")
    writes = {
        "ours (direct)": ours["api_writes_per_reconcile"],
        "ours (timer)": result["timer_driven_noop"]["api_writes_per_reconcile"],
        "blind apply": blind["api_writes_per_reconcile"],
    }
    axes[2].bar(list(writes), list(writes.values()), color=["tab:blue", "tab:cyan", "tab:orange"])
    axes[2].set_title("API writes per no-op reconcile (target 0)")
    common.save(fig, path, dpi=110)


def summary(r: dict[str, Any]) -> str:
    ours, blind, timer = r["noop_reconcile"], r["blind_apply_peer"], r["timer_driven_noop"]
    lat = r["creation_latency_seconds"]
    limit = r["api_get_per_second_limit"] / max(ours["api_reads_per_reconcile"], 1)
    return "\n".join(
        [
            f"creation -> all owned objects: p50 {1000 * lat['p50']:.0f} ms, p95 {1000 * lat['p95']:.0f} ms",
            f"bulk: {r['engines']} engines rendered in {r['bulk_create']['seconds']:.1f} s "
            f"({r['bulk_create']['engines_per_second']:.1f} engines/s, {r['bulk_create']['objects_per_second']:.0f} objects/s)",
            f"no-op reconcile: {ours['reconciles_per_second']:.0f}/s, {ours['api_writes_per_reconcile']:.2f} writes each "
            f"({ours['api_reads_per_reconcile']:.1f} reads); API read limit {limit:.0f}/s "
            f"-> {ours['reconciles_per_second'] / limit:.2f}x of the limit",
            f"blind-apply peer: {blind['reconciles_per_second']:.0f}/s, {blind['api_writes_per_reconcile']:.2f} writes each "
            f"-> ours is {ours['reconciles_per_second'] / blind['reconciles_per_second']:.2f}x its rate with 0 writes",
            f"after the blind pass, ours again: {r['noop_reconcile_after_blind_pass']['api_writes_per_reconcile']:.2f} writes each",
            f"timer-driven (Kopf included): {timer['reconciles']:.0f} reconciles, {timer['api_writes']} writes "
            f"({timer['api_writes_per_reconcile']:.3f} per reconcile)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--latency-samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "operator.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.ERROR)
    result = asyncio.run(run(args.engines, args.latency_samples))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(summary(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
