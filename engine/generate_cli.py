"""`pagedinfer generate`: one prompt through the offline engine, streamed text on stdout."""

from __future__ import annotations

import argparse
import sys

from pagedinfer.engine.config import DEFAULT_MODEL_URI, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.sampling_params import SamplingParams


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--model", default=DEFAULT_MODEL_URI, help="model URI (builtin://, hf://, a path)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedinfer.engine.llm import LLM

    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig(
        model=args.model,
        scheduler=SchedulerConfig(max_model_len=args.max_model_len, max_num_seqs=max(16, args.n)),
        device=DeviceConfig(device=args.device, dtype=args.dtype),
    )
    llm = LLM(config)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt_ids = llm.tokenizer.encode_chat(messages)
    else:
        prompt_ids = llm.tokenizer.encode(prompt)
    try:
        (result,) = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for c in result.completions:
        if len(result.completions) > 1:
            print(f"--- [{c.index}] ---")
        print(c.text)
    u = result.usage
    timing = result.timing
    rate = f", {timing.tokens_per_second:.1f} tok/s" if timing else ""
    print(
        f"[{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, "
        f"finish={result.finish_reason.value if result.finish_reason else None}{rate}]",
        file=sys.stderr,
    )
    return 0
