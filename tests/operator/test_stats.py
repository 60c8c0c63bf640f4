"""Stats from the engines' /metrics: parsing, aggregation, and a scrape of live local servers."""

from __future__ import annotations

from aiohttp import web

from pagedinfer.operator.stats import Scraper, aggregate, parse_metrics, scrape_targets

EXPOSITION = """# HELP pagedinfer_generation_tokens_per_second Tokens generated per second
# TYPE pagedinfer_generation_tokens_per_second gauge
pagedinfer_generation_tokens_per_second{model="smol"} 120.5
# TYPE pagedinfer_kv_cache_usage_ratio gauge
pagedinfer_kv_cache_usage_ratio{model="smol"} 0.3
# TYPE pagedinfer_num_requests_waiting gauge
pagedinfer_num_requests_waiting{model="smol"} 3
# TYPE pagedinfer_num_requests_running gauge
pagedinfer_num_requests_running{model="smol"} 8
# TYPE other_metric counter
other_metric_total 5
"""


def test_parse_and_aggregate():
    sample = parse_metrics(EXPOSITION)
    assert (sample.tokens_per_second, sample.kv_cache_usage, sample.num_waiting, sample.num_running) == (
        120.5,
        0.3,
        3,
        8,
    )
    empty = parse_metrics("")
    stats = aggregate([sample, empty])
    assert stats == {
        "tokensPerSecond": 120.5,
        "kvCacheUsagePercent": 15,
        "numRequestsWaiting": 3,
        "numRequestsRunning": 8,
        "numPodsScraped": 2,
    }
    assert aggregate([])["numPodsScraped"] == 0


def test_only_ready_running_pods_are_targets():
    ready = {
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    unready = {
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.2",
            "conditions": [{"type": "Ready", "status": "False"}],
        }
    }
    no_ip = {"status": {"phase": "Pending", "conditions": []}}
    v6 = {
        "status": {
            "phase": "Running",
            "podIP": "fd00::1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    assert scrape_targets([ready, unready, no_ip, v6], 8000) == [
        "http://10.0.0.1:8000/metrics",
        "http://[fd00::1]:8000/metrics",
    ]


async def test_scraper_reads_live_servers_and_skips_dead_ones(unused_tcp_port_factory):
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=EXPOSITION)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port, dead_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    scraper = Scraper(timeout_seconds=1.0)
    try:
        urls = [f"http://127.0.0.1:{port}/metrics"] * 2 + [f"http://127.0.0.1:{dead_port}/metrics"]
        samples = await scraper.scrape(urls)
    finally:
        await scraper.close()
        await runner.cleanup()
    assert len(samples) == 2
    assert aggregate(samples)["tokensPerSecond"] == 241.0
