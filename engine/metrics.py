"""Every Prometheus collector of the engine and its servers, declared once.

`ServingMetrics` owns one `CollectorRegistry` per server (no process-global registry), so tests
can run several servers in one process. Request-level series (latency histograms, token
counters, finish reasons) are recorded by the servers as streams finish; engine-level series
(queue depths, KV-cache usage, preemptions, speculative decoding) are read from
`engine.stats()` at scrape time by `_EngineStatsCollector`, which is also how the
Gateway API Inference Extension names (`vllm:*`, with a colon) are exported.

With several API-server processes (`--api-server-count N`, `api_server_index` set) the
request-level series live in prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR,
made by the launcher) and /metrics merges every process's (`scrape_registry`): counters and
histograms are summed. The engine's gauges stay scrape-time reads of the answering process's
mirror of the core's stats, so they are never in those files and never summed N times. An API
server with nothing new in a step (none of its requests' outputs, the same waiting count) gets
the core's stats only every shared_core.STATS_INTERVAL_S (0.1 s) and when the core goes idle, so
its mirror may be that stale. A counter read from two processes' mirrors could then go back
between scrapes, which Prometheus takes for a reset: the engine's counters (speculative decoding,
preemptions) are instead counted from the StepStats every process receives (those of steps it
skipped come with the next message), by API server 0 alone, into the multiprocess files.
`pagedinfer_api_server_requests_total{api_server}` shows how requests spread over the processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.outputs import RequestOutput

PREFIX = "pagedinfer_"

# Request-level histograms (label: model).
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
PROMPT_TOKENS_HIST = PREFIX + "request_prompt_tokens"
GENERATION_TOKENS_HIST = PREFIX + "request_generation_tokens"
# Counters (exposition names carry _total).
PROMPT_TOKENS_TOTAL = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS_TOTAL = PREFIX + "generation_tokens_total"
REQUESTS_TOTAL = PREFIX + "requests_total"  # label finish_reason
PREEMPTIONS_TOTAL = PREFIX + "preemptions_total"
SPEC_DRAFT_TOKENS_TOTAL = PREFIX + "spec_decode_draft_tokens_total"
SPEC_ACCEPTED_TOKENS_TOTAL = PREFIX + "spec_decode_accepted_tokens_total"
# label position (0: the first draft token): their ratio is the acceptance at that position, what
# tells whether a larger K would pay (vLLM's spec_decode_num_accepted_tokens_per_pos)
SPEC_DRAFT_PER_POSITION_TOTAL = PREFIX + "spec_decode_draft_tokens_per_position_total"
SPEC_ACCEPTED_PER_POSITION_TOTAL = PREFIX + "spec_decode_accepted_tokens_per_position_total"
# Gauges, read from engine.stats() at scrape time.
NUM_RUNNING = PREFIX + "num_requests_running"
NUM_WAITING = PREFIX + "num_requests_waiting"
KV_USAGE = PREFIX + "kv_cache_usage_ratio"
KV_FRAGMENTATION = PREFIX + "kv_cache_fragmentation_ratio"
PREFIX_HIT = PREFIX + "prefix_cache_hit_ratio"
SPEC_ACCEPTANCE = PREFIX + "spec_decode_acceptance_ratio"
SPEC_MEAN_ACCEPTED_LENGTH = PREFIX + "spec_decode_mean_accepted_length"
GEN_TPS = PREFIX + "generation_tokens_per_second"
KV_FREE_BLOCKS = PREFIX + "kv_cache_free_blocks"  # debug: returns to the total once all requests end
KV_TOTAL_BLOCKS = PREFIX + "kv_cache_total_blocks"
SERVER_READY = PREFIX + "server_ready"  # 1 once the model is loaded and the server is not draining
# Gateway API Inference Extension model-server protocol (vLLM's names and label).
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"

# Every metric family name as exposed (counters with their _total suffix).
METRIC_NAMES: tuple[str, ...] = (
    TTFT,
    ITL,
    E2E,
    QUEUE_TIME,
    PROMPT_TOKENS_HIST,
    GENERATION_TOKENS_HIST,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    REQUESTS_TOTAL,
    PREEMPTIONS_TOTAL,
    SPEC_DRAFT_TOKENS_TOTAL,
    SPEC_ACCEPTED_TOKENS_TOTAL,
    SPEC_DRAFT_PER_POSITION_TOTAL,
    SPEC_ACCEPTED_PER_POSITION_TOTAL,
    NUM_RUNNING,
    NUM_WAITING,
    KV_USAGE,
    KV_FRAGMENTATION,
    PREFIX_HIT,
    SPEC_ACCEPTANCE,
    SPEC_MEAN_ACCEPTED_LENGTH,
    GEN_TPS,
    KV_FREE_BLOCKS,
    KV_TOTAL_BLOCKS,
    SERVER_READY,
    VLLM_WAITING,
    VLLM_RUNNING,
    VLLM_KV_USAGE,
)
# Only with several API-server processes: finished requests per process (label api_server).
API_SERVER_REQUESTS_TOTAL = PREFIX + "api_server_requests_total"
VLLM_METRIC_NAMES: tuple[str, ...] = (VLLM_WAITING, VLLM_RUNNING, VLLM_KV_USAGE)  # off with --no-vllm-metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75)
_LATENCY_BUCKETS += (1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075)
_ITL_BUCKETS += (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# engine.stats() keys (first present wins) -> gauge name.
_STAT_GAUGES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("num_running",), NUM_RUNNING, "Requests in the running batch."),
    (("num_waiting",), NUM_WAITING, "Requests waiting to be scheduled."),
    (("kv_cache_usage",), KV_USAGE, "Fraction of KV-cache blocks in use (0..1)."),
    (("fragmentation",), KV_FRAGMENTATION, "Fraction of allocated KV slots holding no token (0..1)."),
    (("prefix_cache_hit_rate",), PREFIX_HIT, "Prefix-cache hit ratio over prompt tokens (0..1)."),
    (("generation_tokens_per_second",), GEN_TPS, "Recent generation throughput of the engine."),
    (("kv_free_blocks", "num_free_blocks"), KV_FREE_BLOCKS, "Free KV-cache blocks (debug: leaks show here)."),
    (("kv_total_blocks", "num_total_blocks"), KV_TOTAL_BLOCKS, "KV-cache blocks in the pool."),
)
# engine.stats() cumulative keys -> counter name.
_PREEMPTIONS_DOC = "Requests preempted to free KV blocks."
_STAT_COUNTERS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("preemptions_total", "num_preemptions_total"), PREEMPTIONS_TOTAL, _PREEMPTIONS_DOC),
)


def _stat(stats: Mapping[str, Any], keys: tuple[str, ...]) -> float:
    for key in keys:
        value = stats.get(key)
        if value is not None:
            return float(value)
    return 0.0


StatsSource = Callable[[], Mapping[str, Any] | None]


def _counter_family(name: str) -> str:
    return name.removesuffix("_total")


class _EngineStatsCollector(Collector):
    """Scrape-time view of `engine.stats()`: gauges, cumulative counters, vllm:* aliases."""

    def __init__(
        self,
        model: str,
        stats: StatsSource,
        is_ready: Callable[[], bool],
        spec: Callable[[], tuple[float, float]],
        vllm_names: bool,
        stat_counters: bool = True,
    ):
        self._model = model
        self._spec = spec  # () -> (acceptance ratio, mean accepted length)
        self._stat_counters = stat_counters  # (False: counted from StepStats instead)
        self._stats = stats
        self._is_ready = is_ready
        self._vllm_names = vllm_names

    def describe(self) -> list[Metric]:
        return list(self._families({}))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._stats() or {})

    def _families(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        labels = [self._model]
        for keys, name, doc in _STAT_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric(labels, _stat(stats, keys))
            yield family
        for keys, name, doc in _STAT_COUNTERS if self._stat_counters else ():
            family = CounterMetricFamily(_counter_family(name), doc, labels=["model"])
            family.add_metric(labels, _stat(stats, keys))
            yield family
        acceptance, mean_length = self._spec()
        accept = GaugeMetricFamily(
            SPEC_ACCEPTANCE, "Accepted / proposed draft tokens (0..1).", labels=["model"]
        )
        accept.add_metric(labels, acceptance)
        yield accept
        length = GaugeMetricFamily(
            SPEC_MEAN_ACCEPTED_LENGTH,
            "Tokens emitted per verifying sequence step (1 + accepted drafts; 0 before any).",
            labels=["model"],
        )
        length.add_metric(labels, mean_length)
        yield length
        ready = GaugeMetricFamily(
            SERVER_READY, "1 when serving, 0 while loading or draining.", labels=["model"]
        )
        ready.add_metric(labels, 1.0 if self._is_ready() else 0.0)
        yield ready
        if self._vllm_names:
            yield from self._vllm_families(stats)

    def _vllm_families(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        aliases = (
            (VLLM_WAITING, "num_waiting", "Requests waiting to be processed."),
            (VLLM_RUNNING, "num_running", "Requests currently running."),
            (VLLM_KV_USAGE, "kv_cache_usage", "KV-cache usage; 1 means 100 percent."),
        )
        for name, key, doc in aliases:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], _stat(stats, (key,)))
            yield family


class ServingMetrics:
    """The collectors of one server process, in their own registry.

    Call `observe_step_gap` for each streamed output after the first and `observe_finished`
    once per request (with the final output, or None when the client went away).
    """

    def __init__(
        self, model: str, *, enable_vllm_metrics: bool = True, api_server_index: int | None = None
    ) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.scrape_registry = self.registry  # what /metrics exposes
        self.is_multiprocess = api_server_index is not None
        self._enable_vllm_metrics = enable_vllm_metrics
        r, labels = self.registry, ["model"]
        self.ttft = Histogram(
            TTFT, "Arrival to first output token.", labels, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            ITL, "Gap between streamed outputs, per token.", labels, registry=r, buckets=_ITL_BUCKETS
        )
        self.e2e = Histogram(E2E, "Arrival to finish.", labels, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram(
            QUEUE_TIME, "Arrival to first scheduled.", labels, registry=r, buckets=_LATENCY_BUCKETS
        )
        self.prompt_hist = Histogram(
            PROMPT_TOKENS_HIST, "Prompt tokens per request.", labels, registry=r, buckets=_TOKEN_BUCKETS
        )
        self.gen_hist = Histogram(
            GENERATION_TOKENS_HIST,
            "Generated tokens per request.",
            labels,
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        # Counted from the engine's steps (on_step): every token it processed, aborted requests'
        # too, as /debug/engine_stats counts them.
        self.prompt_total = Counter(
            _counter_family(PROMPT_TOKENS_TOTAL),
            "Prompt tokens the engine computed (prefix-cache hits are not computed; a preempted "
            "sequence's recompute counts again).",
            labels,
            registry=r,
        )
        self.gen_total = Counter(
            _counter_family(GENERATION_TOKENS_TOTAL), "Tokens the engine generated.", labels, registry=r
        )
        self.requests = Counter(
            _counter_family(REQUESTS_TOTAL), "Finished requests.", ["model", "finish_reason"], registry=r
        )
        self._spec_lock = threading.Lock()
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._num_verified_seqs = 0
        self._api_server_requests = None
        if self.is_multiprocess:
            self._init_multiprocess(str(api_server_index))
        self.spec_draft = Counter(
            _counter_family(SPEC_DRAFT_TOKENS_TOTAL), "Draft tokens proposed.", labels, registry=r
        )
        self.spec_accepted = Counter(
            _counter_family(SPEC_ACCEPTED_TOKENS_TOTAL), "Draft tokens accepted.", labels, registry=r
        )
        by_position = ["model", "position"]
        self.spec_draft_by_position = Counter(
            _counter_family(SPEC_DRAFT_PER_POSITION_TOTAL),
            "Draft tokens verified at each draft position (0: the first).",
            by_position,
            registry=r,
        )
        self.spec_accepted_by_position = Counter(
            _counter_family(SPEC_ACCEPTED_PER_POSITION_TOTAL),
            "Draft tokens accepted at each draft position (0: the first).",
            by_position,
            registry=r,
        )
        self._by_position: list[tuple[Any, Any]] = []  # per position: (draft, accepted) series
        # Every process sees every step: one counts the engine's step counters into the shared
        # files (summed over processes), the others only create the series at 0.
        self._counts_steps = api_server_index in (None, 0)
        self._preemptions = None
        if self.is_multiprocess:  # (one process: read from the engine's stats at scrape time)
            self._preemptions = Counter(
                _counter_family(PREEMPTIONS_TOTAL), _PREEMPTIONS_DOC, labels, registry=r
            ).labels(model)
        # The per-model series, looked up once: `labels()` costs a lock and a dict lookup per
        # call, ~11 calls per request and one per streamed output otherwise. Created here, they
        # also exist (at zero) from the first scrape, not only after the first request.
        self._ttft, self._itl, self._e2e, self._queue, self._prompt_hist, self._gen_hist = (
            metric.labels(model)
            for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_hist, self.gen_hist)
        )
        self._prompt_total, self._gen_total = (
            counter.labels(model) for counter in (self.prompt_total, self.gen_total)
        )
        self._spec_draft, self._spec_accepted = (
            counter.labels(model) for counter in (self.spec_draft, self.spec_accepted)
        )
        self._requests_by_reason: dict[str, Any] = {}

    def _init_multiprocess(self, api_server: str) -> None:
        from prometheus_client import multiprocess

        self.scrape_registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(self.scrape_registry)  # every process's files, merged
        requests = Counter(
            _counter_family(API_SERVER_REQUESTS_TOTAL),
            "Finished requests per API-server process.",
            ["model", "api_server"],
            registry=self.registry,
        )
        self._api_server_requests = requests.labels(self.model, api_server)

    def attach_engine(self, stats: StatsSource, is_ready: Callable[[], bool]) -> None:
        """Export the engine's scrape-time series; call once, before serving /metrics."""
        collector = _EngineStatsCollector(
            self.model,
            stats,
            is_ready,
            self._spec_gauges,
            self._enable_vllm_metrics,
            not self.is_multiprocess,
        )
        self.scrape_registry.register(collector)

    def on_step(self, step: StepStats) -> None:
        """Engine step listener (runs on the engine thread; prometheus_client is thread-safe)."""
        if self._preemptions is not None and self._counts_steps and step.num_preemptions:
            self._preemptions.inc(step.num_preemptions)
        if self._counts_steps:
            if step.num_prompt_tokens:
                self._prompt_total.inc(step.num_prompt_tokens)
            if step.num_generation_tokens:
                self._gen_total.inc(step.num_generation_tokens)
        if not step.num_draft_tokens:
            return
        if self._counts_steps:
            self._spec_draft.inc(step.num_draft_tokens)
            self._spec_accepted.inc(step.num_accepted_tokens)
            for i, (drafted, accepted) in enumerate(
                zip(step.draft_tokens_per_position, step.accepted_tokens_per_position, strict=True)
            ):
                draft_series, accepted_series = self._position_series(i)
                draft_series.inc(drafted)
                accepted_series.inc(accepted)
        with self._spec_lock:
            self._num_draft_tokens += step.num_draft_tokens
            self._num_accepted_tokens += step.num_accepted_tokens
            self._num_verified_seqs += step.num_verified_seqs

    def _position_series(self, position: int) -> tuple[Any, Any]:
        while len(self._by_position) <= position:
            label = str(len(self._by_position))
            self._by_position.append(
                (
                    self.spec_draft_by_position.labels(self.model, label),
                    self.spec_accepted_by_position.labels(self.model, label),
                )
            )
        return self._by_position[position]

    def acceptance_ratio(self) -> float:
        """Accepted / proposed draft tokens since start (0 without speculation)."""
        with self._spec_lock:
            return self._num_accepted_tokens / self._num_draft_tokens if self._num_draft_tokens else 0.0

    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying sequence step since start (0 before any verification)."""
        with self._spec_lock:
            verified = self._num_verified_seqs
            return (self._num_accepted_tokens + verified) / verified if verified else 0.0

    def _spec_gauges(self) -> tuple[float, float]:
        return self.acceptance_ratio(), self.mean_accepted_length()

    def observe_step_gap(self, seconds: float, num_new_tokens: int) -> None:
        if num_new_tokens > 0:
            self._itl.observe(seconds / num_new_tokens)

    def observe_finished(self, final: RequestOutput | None, finish_reason: str) -> None:
        requests = self._requests_by_reason.get(finish_reason)
        if requests is None:  # a handful of reasons: each looked up once
            requests = self._requests_by_reason[finish_reason] = self.requests.labels(
                self.model, finish_reason
            )
        requests.inc()
        if self._api_server_requests is not None:
            self._api_server_requests.inc()
        if final is None:
            return
        usage, timing = final.usage, final.timing
        if usage is not None:  # (the token counters come from the steps: on_step)
            self._prompt_hist.observe(usage.prompt_tokens)
            self._gen_hist.observe(usage.completion_tokens)
        if timing is not None:
            self._queue.observe(timing.queue_time)
            self._e2e.observe(timing.e2e_latency)
            if usage is None or usage.completion_tokens > 0:
                self._ttft.observe(timing.time_to_first_token)
