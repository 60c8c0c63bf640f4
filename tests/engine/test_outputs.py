"""merge_outputs: several streamed updates of one request as one, nothing lost or reordered."""

from __future__ import annotations

from pagedinfer.engine.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestTiming,
    SampleLogprobs,
    TokenLogprob,
    Usage,
    merge_outputs,
)


def lp(token_id: int, logprob: float) -> SampleLogprobs:
    return SampleLogprobs(TokenLogprob(token_id, f"t{token_id}", logprob), (TokenLogprob(9, "t9", -3.0),))


def test_merge_concatenates_per_index_and_keeps_finish_usage_timing() -> None:
    timing = RequestTiming(0.1, 0.2, 0.3, 0.5, 10.0)
    usage = Usage(prompt_tokens=4, completion_tokens=5, cached_prompt_tokens=2)
    outs = [
        RequestOutput(
            "r", [CompletionDelta(0, "He", [1], [lp(1, -0.1)]), CompletionDelta(1, "A", [7], [lp(7, -1.0)])]
        ),
        RequestOutput("r", [CompletionDelta(1, "B", [8], [lp(8, -2.0)], FinishReason.STOP, stop_reason=8)]),
        RequestOutput(
            "r",
            [CompletionDelta(0, "llo", [2, 3], [lp(2, -0.2), lp(3, -0.3)], FinishReason.LENGTH)],
            finished=True,
            usage=usage,
            timing=timing,
        ),
    ]
    merged = merge_outputs(outs)
    assert merged.request_id == "r" and merged.finished and merged.usage == usage and merged.timing == timing
    first, second = sorted(merged.deltas, key=lambda d: d.index)
    assert (first.text, first.token_ids) == ("Hello", [1, 2, 3])
    assert [x.sampled.token_id for x in first.logprobs] == [1, 2, 3]
    assert [x.sampled.logprob for x in first.logprobs] == [-0.1, -0.2, -0.3]
    assert first.finish_reason is FinishReason.LENGTH and first.stop_reason is None
    assert (second.text, second.token_ids, second.finish_reason, second.stop_reason) == (
        "AB",
        [7, 8],
        FinishReason.STOP,
        8,
    )
    assert [x.sampled.token_id for x in second.logprobs] == [7, 8]
    # the inputs are left as they were (they may still be referenced elsewhere)
    assert outs[0].deltas[0].text == "He" and outs[0].deltas[0].token_ids == [1]


def test_merge_without_logprobs_unfinished_and_single() -> None:
    outs = [
        RequestOutput("q", [CompletionDelta(0, "a", [1])]),
        RequestOutput("q", [CompletionDelta(0, "b", [2])]),
    ]
    merged = merge_outputs(outs)
    assert not merged.finished and merged.usage is None and merged.timing is None
    (d,) = merged.deltas
    assert (d.text, d.token_ids, d.logprobs, d.finish_reason) == ("ab", [1, 2], None, None)
    assert merge_outputs(outs[:1]) is outs[0]


def test_merge_keeps_an_error_finish() -> None:
    outs = [
        RequestOutput("e", [CompletionDelta(0, "x", [4])]),
        RequestOutput(
            "e", [CompletionDelta(0, finish_reason=FinishReason.ERROR, error="too long")], finished=True
        ),
    ]
    (d,) = merge_outputs(outs).deltas
    assert (d.text, d.token_ids, d.finish_reason, d.error) == ("x", [4], FinishReason.ERROR, "too long")
