"""/v1/completions beyond one prompt and its generated text, on SmolLM2 (fp32, CPU), with the
openai SDK and lm-eval against a live server, checked against transformers on the same weights:
echo (with and without logprobs, max_tokens 0), prompt_logprobs, several prompts (strings and
token lists) with n, best_of, logit_bias; and the small endpoints around them (GET
/v1/models/{id}, /tokenize, /detokenize, gRPC Detokenize and reflection v1), the developer role.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2

from pagedinfer.engine.models.builtin import BUILTIN_MODELS
from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

TASK_DIR = Path(__file__).parent / "lm_eval_task"
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def _gguf_path() -> Path:
    entry = BUILTIN_MODELS["smollm2-135m"]
    spec = importlib.util.find_spec(entry.package)
    return Path(next(iter(spec.submodule_search_locations))) / entry.filename


@pytest.fixture(scope="module")
def hf_model():
    """transformers on the same GGUF (as tests/engine/models/test_smollm2.py loads it)."""
    transformers = pytest.importorskip("transformers")
    path = _gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1] logprob of each token after the first, given the ones before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


def tokenize(server, prompt: str) -> list[int]:
    r = httpx.post(f"{server.http}/tokenize", json={"prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_echo_with_logprobs_and_max_tokens_0_is_the_prompt_scored(client, model, server, hf_model) -> None:
    ids = tokenize(server, PROMPT)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    (choice,) = out.choices
    assert choice.text == PROMPT and out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has none
    reference = hf_logprobs(hf_model, ids)
    assert lp.token_logprobs[1:] == pytest.approx(reference.tolist(), abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_without_logprobs_puts_the_prompt_before_the_text(client, model) -> None:
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_prompt_logprobs_match_transformers(server, model, hf_model) -> None:
    ids = tokenize(server, PROMPT)
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    r = httpx.post(f"{server.http}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for pos, entry in enumerate(entries[1:]):
        token = entry[str(ids[pos + 1])]
        assert token["logprob"] == pytest.approx(reference[pos, ids[pos + 1]].item(), abs=1e-3)
        top_lp, top_ids = reference[pos].topk(2)
        for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_lp.tolist(), strict=True), start=1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-3)


def test_several_prompts_with_n_index_as_openai(client, model, server) -> None:
    prompts = ["One, two, three,", "Roses are red,"]
    singles = [
        client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0).choices[0].text
        for p in prompts
    ]
    for prompt in (prompts, [tokenize(server, p) for p in prompts]):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, n=2)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt_index * n + i
        assert [c.text for c in out.choices] == [singles[0], singles[0], singles[1], singles[1]]
        assert out.usage.completion_tokens == 12


def test_best_of_returns_the_highest_logprob_sequences(client, model) -> None:
    kwargs = {
        "model": model,
        "prompt": "My favourite food is",
        "max_tokens": 4,
        "temperature": 1.0,
        "seed": 7,
    }
    every = client.completions.create(n=3, logprobs=0, **kwargs).choices
    best = client.completions.create(n=1, best_of=3, **kwargs).choices
    cumulative = {c.text: sum(c.logprobs.token_logprobs) for c in every}
    assert len(best) == 1 and best[0].text == max(cumulative, key=cumulative.get) and best[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=2, best_of=1, **kwargs)


def test_logit_bias_removes_the_greedy_token(client, model, server) -> None:
    prompt = "The capital of France is"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    token = first.choices[0].logprobs.tokens[0]
    (token_id,) = tokenize(server, prompt + token)[len(tokenize(server, prompt)) :]
    biased = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(token_id): -100}
    )
    assert first.choices[0].text == " Paris" and biased.choices[0].text not in ("", " Paris")
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
        logit_bias={str(token_id): -100},
    )
    assert " Paris" not in chat.choices[0].message.content


def test_echo_and_prompt_lists_refuse_to_stream(client, model) -> None:
    with pytest.raises(openai.BadRequestError, match="echo"):
        list(client.completions.create(model=model, prompt="hi", max_tokens=1, echo=True, stream=True))
    with pytest.raises(openai.BadRequestError, match="prompt"):
        list(client.completions.create(model=model, prompt=["a", "b"], max_tokens=1, stream=True))


def test_developer_role_is_the_system_role(client, model) -> None:
    def answer(role: str) -> str:
        messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Say hello."}]
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        return out.choices[0].message.content

    assert answer("developer") == answer("system")


def test_get_model_by_id(client, model, server) -> None:
    assert client.models.retrieve(model).id == model
    r = httpx.get(f"{server.http}/v1/models/no-such-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_http_and_grpc(server, model) -> None:
    r = httpx.post(
        f"{server.http}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, timeout=30
    )
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 1024
    chat = httpx.post(
        f"{server.http}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30
    )
    assert chat.json()["count"] > body["count"]  # the template's tokens around it
    back = httpx.post(f"{server.http}/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "Hello world"}
    bad = httpx.post(f"{server.http}/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        text = pb_grpc.InferenceServiceStub(channel).Detokenize(
            pb.DetokenizeRequest(token_ids=body["tokens"])
        )
        assert text.text == "Hello world"


def test_grpc_reflection_v1(server) -> None:
    """grpcurl asks grpc.reflection.v1 first: the same messages as v1alpha, another service name."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (response,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
    names = {s.name for s in response.list_services_response.service}
    assert {"pagedinfer.v1.InferenceService", "grpc.reflection.v1.ServerReflection"} <= names


def test_reported_ttft_is_when_the_client_gets_the_first_token(server, model) -> None:
    """The `timing` a stream reports measures the time to first token as the client sees it: on
    the CPU a token used to reach the client one engine step after it was counted (issue 46)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    runs = []
    for _ in range(3):
        arrivals, timing = [], None
        start = time.monotonic()
        with httpx.stream("POST", f"{server.http}/v1/completions", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    timing = json.loads(line[6:]).get("timing") or timing
        assert len(arrivals) == 8  # one event per token: each step's token leaves when it exists
        step = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)  # a decode step, client-side
        runs.append((arrivals[0] - start - timing["time_to_first_token_seconds"], step))
    lag, step = min(runs)
    assert 0 <= lag < 0.5 * step, runs  # (a token one step late: lag ~ step)


def _lm_eval_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's _encode_pair: trailing spaces of the context move to the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    num_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return whole[:num_context], whole[num_context:]


def test_lm_eval_multiple_choice_picks_what_transformers_picks(
    server, model, hf_model, tmp_path, monkeypatch
) -> None:
    """lm-eval's local-completions model (echo + logprobs + max_tokens 1, prompts as token-id
    lists) on a local 5-question task: the same answers as transformers, the same scores."""
    transformers = pytest.importorskip("transformers")
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = TASK_DIR / "mc_questions.jsonl"
    template = (TASK_DIR / "pagedinfer_mc.yaml.template").read_text()
    (tmp_path / "pagedinfer_mc.yaml").write_text(template.replace("DATA_FILE", str(data)))
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={model},base_url={server.http}/v1/completions,tokenizer={tmp_path / 'tokenizer'},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True"
        ),
        tasks=["pagedinfer_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = sorted(results["samples"]["pagedinfer_mc"], key=lambda s: s["doc_id"])
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(samples) == len(docs) == 5
    for sample, doc in zip(samples, docs, strict=True):
        ours = [resp[0][0] for resp in sample["resps"]]  # per choice: (sum logprob, is_greedy)
        theirs = []
        for context, continuation in (arg for arg in sample["arguments"]):
            ctx, cont = _lm_eval_pair(tokenizer, context, continuation)
            theirs.append(hf_logprobs(hf_model, ctx + cont)[len(ctx) - 1 :].sum().item())
        assert ours == pytest.approx(theirs, abs=5e-3), doc["question"]
        assert max(range(4), key=ours.__getitem__) == max(range(4), key=theirs.__getitem__), doc["question"]
    assert results["results"]["pagedinfer_mc"]["acc,none"] >= 0.6  # (SmolLM2 knows most of these)
