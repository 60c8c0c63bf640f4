"""ServingMetrics: every declared name is exported, per-server registries, vllm:* aliases."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.engine import metrics as m
from pagedinfer.engine.core.scheduler_output import StepStats
from pagedinfer.engine.outputs import CompletionDelta, FinishReason, RequestOutput, RequestTiming, Usage


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _family_names(registry) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def _step(**kwargs) -> StepStats:
    base = dict(step=1, num_running=1, num_waiting=0, num_scheduled_tokens=1, num_prompt_tokens=0)
    base |= dict(num_generation_tokens=1, num_preemptions=0, num_finished=0, kv_cache_usage=0.1)
    return StepStats(**(base | kwargs))


def _final(prompt: int, completion: int) -> RequestOutput:
    timing = RequestTiming(
        queue_time=0.01, time_to_first_token=0.2, decode_time=0.5, e2e_latency=0.7, tokens_per_second=14.0
    )
    delta = CompletionDelta(index=0, text="x", token_ids=[1], finish_reason=FinishReason.LENGTH)
    return RequestOutput("r", [delta], finished=True, usage=Usage(prompt, completion), timing=timing)


def test_every_declared_name_is_exported() -> None:
    sm = m.ServingMetrics("tiny")
    sm.attach_engine(lambda: {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25}, lambda: True)
    sm.observe_finished(_final(5, 3), "length")
    sm.observe_step_gap(0.1, 2)
    # two sequences verified 4 drafts each: one accepted all, the other the first two
    per_position = {"draft_tokens_per_position": (2, 2, 2, 2), "accepted_tokens_per_position": (2, 2, 1, 1)}
    sm.on_step(
        _step(
            num_draft_tokens=8,
            num_accepted_tokens=6,
            num_verified_seqs=2,
            num_prompt_tokens=5,
            **per_position,
        )
    )
    sm.on_step(_step(num_draft_tokens=0, num_accepted_tokens=0))
    assert _family_names(sm.registry) == set(m.METRIC_NAMES)
    s = _samples(sm.registry)
    assert s[("vllm:num_requests_running", (("model_name", "tiny"),))] == 2
    assert s[("pagedinfer_kv_cache_usage_ratio", (("model", "tiny"),))] == 0.25
    assert s[("pagedinfer_requests_total", (("finish_reason", "length"), ("model", "tiny")))] == 1
    # token counters: the steps' (1 generated token each), not the finished request's usage
    assert s[("pagedinfer_generation_tokens_total", (("model", "tiny"),))] == 2
    assert s[("pagedinfer_prompt_tokens_total", (("model", "tiny"),))] == 5
    assert s[("pagedinfer_inter_token_latency_seconds_sum", (("model", "tiny"),))] == 0.05
    assert s[("pagedinfer_server_ready", (("model", "tiny"),))] == 1
    assert s[("pagedinfer_spec_decode_draft_tokens_total", (("model", "tiny"),))] == 8
    assert s[("pagedinfer_spec_decode_accepted_tokens_total", (("model", "tiny"),))] == 6
    assert s[("pagedinfer_spec_decode_acceptance_ratio", (("model", "tiny"),))] == 0.75
    # Two sequences verified 4 drafts each, 6 accepted: (6 + 2) / 2 tokens per verifying step.
    assert s[("pagedinfer_spec_decode_mean_accepted_length", (("model", "tiny"),))] == 4.0
    for i, accepted in enumerate((2, 2, 1, 1)):
        labels = (("model", "tiny"), ("position", str(i)))
        assert s[("pagedinfer_spec_decode_draft_tokens_per_position_total", labels)] == 2
        assert s[("pagedinfer_spec_decode_accepted_tokens_per_position_total", labels)] == accepted


def test_vllm_names_switch_off_and_registries_are_independent() -> None:
    a = m.ServingMetrics("a", enable_vllm_metrics=False)
    b = m.ServingMetrics("b")
    a.attach_engine(lambda: None, lambda: False)  # still loading: stats unavailable
    b.attach_engine(lambda: {}, lambda: True)
    a.observe_finished(_final(4, 2), "stop")
    assert not _family_names(a.registry) & set(m.VLLM_METRIC_NAMES)
    assert set(m.VLLM_METRIC_NAMES) <= _family_names(b.registry)
    assert ("pagedinfer_requests_total", (("finish_reason", "stop"), ("model", "b"))) not in _samples(
        b.registry
    )


def test_abandoned_request_counts_as_abort_without_latency() -> None:
    sm = m.ServingMetrics("t")
    sm.observe_finished(None, "abort")
    s = _samples(sm.registry)
    assert s[("pagedinfer_requests_total", (("finish_reason", "abort"), ("model", "t")))] == 1
    assert s[("pagedinfer_e2e_request_latency_seconds_count", (("model", "t"),))] == 0
