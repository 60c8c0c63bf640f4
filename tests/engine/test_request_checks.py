import pytest

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.request_checks import RequestLimits, check_request
from pagedinfer.engine.sampling_params import SamplingParams

# 8 blocks of 4 slots: a prompt of 31 tokens (+1 output) fills the pool exactly.
LIMITS = RequestLimits(max_model_len=64, vocab_size=100, block_size=4, num_blocks=8, max_num_seqs=3)
ONE = SamplingParams(n=1)


@pytest.mark.parametrize(
    ("prompt", "n", "limits", "message"),
    [
        ([], 1, LIMITS, "the prompt is empty"),
        ([1] * 64, 1, LIMITS, "the prompt has 64 tokens; this model's context is 64 "),
        ([1, -1], 1, LIMITS, r"prompt token ids must lie in \[0, 100\)"),
        ([1, 100], 1, LIMITS, r"prompt token ids must lie in \[0, 100\)"),
        ([1] * 32, 1, LIMITS, "the prompt needs 9 KV blocks; the cache has 8"),
        ([1], 4, LIMITS, "n=4 exceeds max_num_seqs=3"),
    ],
)
def test_each_check_raises_its_message(prompt, n, limits, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_request(prompt, SamplingParams(n=n), limits)


@pytest.mark.parametrize(
    ("prompt", "n", "limits"),
    [
        ([0, 99], 1, LIMITS),  # both ends of the vocabulary
        ([1] * 31, 3, LIMITS),  # 31 + 1 tokens fill the 8 blocks; n at max_num_seqs
        ([10**6], 1, RequestLimits(64, None, 4, 8, 3)),  # no vocabulary: ids unchecked
    ],
)
def test_requests_at_the_limits_pass(prompt, n, limits):
    check_request(prompt, SamplingParams(n=n, max_tokens=1), limits)


def test_prompt_plus_max_tokens_must_fit_the_pool():
    """8 blocks of 4: a 10-token prompt (2 full blocks shared by the n sequences, 2 tokens in a
    third) leaves 6 blocks: 24 KV slots, 23 new tokens for one sequence (the last one is sampled,
    never fed: it needs no slot), 11 each for two."""
    check_request([1] * 10, SamplingParams(max_tokens=23), LIMITS)
    with pytest.raises(InvalidRequestError, match="at most 23 new tokens per sequence fit"):
        check_request([1] * 10, SamplingParams(max_tokens=24), LIMITS)
    check_request([1] * 10, SamplingParams(n=2, max_tokens=11), LIMITS)
    with pytest.raises(InvalidRequestError, match=r"plus max_tokens \(12\) for n=2 .* at most 11 new"):
        check_request([1] * 10, SamplingParams(n=2, max_tokens=12), LIMITS)
    check_request([1] * 10, SamplingParams(max_tokens=None), LIMITS)  # to the context: checked as it runs


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        ((5, 100), r"stop_token_ids must lie in \[0, 100\), got \[5, 100\]"),
        ((-1,), r"stop_token_ids must lie in \[0, 100\)"),
    ],
)
def test_stop_token_ids_out_of_the_vocabulary_are_refused(stops, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_request([1], SamplingParams(stop_token_ids=stops), LIMITS)
    check_request([1], SamplingParams(stop_token_ids=(0, 99)), LIMITS)  # both ends pass


def test_stop_token_ids_without_a_vocabulary_need_only_be_non_negative():
    limits = RequestLimits(64, None, 4, 8, 3)
    check_request([1], SamplingParams(stop_token_ids=(2**31,)), limits)
    with pytest.raises(InvalidRequestError, match="stop_token_ids must lie in >= 0"):
        check_request([1], SamplingParams(stop_token_ids=(-3,)), limits)


def test_checks_run_in_order():
    # Too long and out of the vocabulary: the context check comes first, as before.
    with pytest.raises(InvalidRequestError, match="context"):
        check_request([1000] * 64, ONE, LIMITS)
