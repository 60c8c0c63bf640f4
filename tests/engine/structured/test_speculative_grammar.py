"""Structured outputs with n-gram speculation on SmolLM2: each draft row is verified under the
grammar state after the drafts before it, so a draft the grammar forbids is rejected and greedy
outputs equal those of plain decoding token for token; sampled outputs (n > 1) still validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedinfer.engine.config import DeviceConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.structured.spec import StructuredOutput

pytestmark = pytest.mark.timeout(600)

# The prompt is full of records whose keys the schema forbids ("name"): prompt lookup drafts them.
RECORDS = "\n".join(json.dumps({"id": i, "name": f"item{i}", "size": i % 3}) for i in range(4))
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "size": {"enum": [0, 1, 2]}},
        "required": ["id", "size"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 2,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        EngineConfig(
            scheduler=SchedulerConfig(max_model_len=1024),
            device=DeviceConfig(device="cpu"),
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        )
    )


def test_speculative_greedy_equals_plain_and_validates(llm) -> None:
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": f"{RECORDS}\nList two records as JSON."}])
    spec = StructuredOutput.json_schema(SCHEMA, strict=True)
    plain, speculative = llm.generate(
        prompt_token_ids=[ids, ids],
        sampling_params=[
            SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec, use_speculation=False),
            SamplingParams(max_tokens=48, temperature=0.0, structured_output=spec),
        ],
    )
    assert speculative.usage.draft_tokens > 0  # drafts were verified under the grammar
    assert speculative.usage.accepted_draft_tokens < speculative.usage.draft_tokens  # ... some rejected
    assert speculative.token_ids == plain.token_ids
    jsonschema.validate(json.loads(speculative.text), SCHEMA)


def test_speculative_sampled_n2_validates(llm) -> None:
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": f"{RECORDS}\nList two records as JSON."}])
    spec = StructuredOutput.json_schema(SCHEMA, strict=True)
    (out,) = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(max_tokens=48, temperature=0.8, seed=3, n=2, structured_output=spec),
    )
    assert out.usage.draft_tokens > 0
    for completion in out.completions:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
