"""Live engine stats from the pods' Prometheus /metrics, for status.stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TOKENS_PER_SECOND = "pagedinfer_generation_tokens_per_second"
KV_CACHE_USAGE = "pagedinfer_kv_cache_usage_ratio"
NUM_WAITING = "pagedinfer_num_requests_waiting"
NUM_RUNNING = "pagedinfer_num_requests_running"
_WANTED = (TOKENS_PER_SECOND, KV_CACHE_USAGE, NUM_WAITING, NUM_RUNNING)


@dataclass(frozen=True)
class PodSample:
    """One pod's gauges (summed over the `model` label)."""

    tokens_per_second: float
    kv_cache_usage: float
    num_waiting: float
    num_running: float


def parse_metrics(text: str) -> PodSample:
    """Sum each wanted gauge over its samples; missing gauges count as zero."""
    totals = dict.fromkeys(_WANTED, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name == family.name)
    return PodSample(
        totals[TOKENS_PER_SECOND], totals[KV_CACHE_USAGE], totals[NUM_WAITING], totals[NUM_RUNNING]
    )


def aggregate(samples: list[PodSample]) -> dict[str, Any]:
    """status.stats: throughput and queues summed, KV usage averaged over pods (percent)."""
    n = len(samples)
    kv = sum(s.kv_cache_usage for s in samples) / n if n else 0.0
    return {
        "tokensPerSecond": round(sum(s.tokens_per_second for s in samples), 1),
        "kvCacheUsagePercent": max(0, min(100, round(kv * 100))),
        "numRequestsWaiting": int(sum(s.num_waiting for s in samples)),
        "numRequestsRunning": int(sum(s.num_running for s in samples)),
        "numPodsScraped": n,
    }


def scrape_targets(pods: list[dict[str, Any]], port: int) -> list[str]:
    """/metrics URLs of the running, ready pods."""
    urls = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        ip = status.get("podIP")
        if ip and ready and status.get("phase", "Running") == "Running":
            host = f"[{ip}]" if ":" in ip else ip
            urls.append(f"http://{host}:{port}/metrics")
    return urls


class Scraper:
    """Fetches /metrics from pods concurrently with a short timeout; failures are skipped."""

    def __init__(self, timeout_seconds: float = 2.0, max_concurrency: int = 16) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._limit = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def startup_report(self, url: str) -> dict[str, Any] | None:
        """A pod's /startup JSON (answered with 503 until it serves); None when it does not answer."""
        async with self._limit:
            try:
                async with self._client().get(url) as resp:
                    body = await resp.json(content_type=None)
                    return body if isinstance(body, dict) else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None

    async def _one(self, url: str) -> PodSample | None:
        self._client()
        async with self._limit:
            try:
                async with self._session.get(url) as resp:
                    if resp.status != 200:
                        return None
                    return parse_metrics(await resp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None

    async def scrape(self, urls: list[str]) -> list[PodSample]:
        results = await asyncio.gather(*(self._one(u) for u in urls))
        return [r for r in results if r is not None]
