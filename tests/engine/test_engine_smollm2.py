"""The embedded SmolLM2-135M through the whole engine: text, stop strings, UTF-8, chat, CLI."""

from __future__ import annotations

import pytest

from pagedinfer.engine.cli import main
from pagedinfer.engine.config import DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.detokenizer import IncrementalDetokenizer
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.outputs import FinishReason
from pagedinfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm():
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=512), device=DeviceConfig(device="cpu"))
    return LLM(config)


def test_greedy_answer_and_stop_string_across_tokens(llm):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (out,) = llm.generate("The capital of France is", params)
    assert "Paris" in out.text and out.usage.prompt_tokens == len(out.prompt_token_ids)
    # Stop on a string that starts inside one token and ends in another.
    stop = out.text[out.text.index("Paris") + 2 :][:5]
    assert len(stop) >= 3
    (cut,) = llm.generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,))
    )
    assert cut.finish_reason is FinishReason.STOP and cut.completions[0].stop_reason == stop
    assert cut.text == out.text[: out.text.index(stop)]
    assert llm.core.scheduler.kv.num_free_blocks == llm.core.scheduler.kv.num_blocks


def test_streamed_text_is_utf8_safe_with_the_real_tokenizer(llm):
    text = "Zürich → 東京 🎉 ça va? Ελληνικά"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(llm.tokenizer, llm.tokenizer.encode("Say: ", add_special_tokens=False))
    pieces = [detok.push([t])[0] for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == llm.tokenizer.decode(ids)


def test_chat_prompt_and_eos(llm):
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    (out,) = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert out.text.strip() and "<|im_end|>" not in out.text
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_cli_generate(capsys):
    assert main(["generate", "--max-tokens", "6", "--device", "cpu", "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "completion tokens" in captured.err
