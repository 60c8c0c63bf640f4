"""Tokenizer: a `tokenizers` backend plus special ids and a Jinja chat template.

Built from a Hugging Face folder (tokenizer.json + tokenizer_config.json) or from GGUF metadata
(byte-level BPE "gpt2" vocabularies: Llama 3, Qwen2, SmolLM2). No transformers at runtime.

Chat prompts are rendered to text by `apply_chat_template` and encoded with
`add_special_tokens=False` (the template writes BOS itself where the model wants it);
`encode_chat` does both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


class TokenizerError(ValueError):
    """A tokenizer that cannot be built (missing or unsupported files/metadata)."""


class ChatTemplateError(ValueError):
    """No chat template, or the template rejected the messages (servers answer 400)."""


# GGUF `tokenizer.ggml.pre` -> the split regex its merges were learned with (llama.cpp's table).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp token types


def _byte_alphabet() -> set[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = 256 - len(printable)
    return {chr(b) for b in printable} | {chr(256 + n) for n in range(extra)}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # single digits first, then GPT-2's regex (SmolLM's own tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def _token_string(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode, special ids, chat template. Immutable after construction; thread-safe reads."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_stop_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        self.chat_template = chat_template
        head = () if self.eos_token_id is None else (self.eos_token_id,)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*head, *extra_stop_token_ids]))
        self._special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self._template = None if chat_template is None else _compile_template(chat_template)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path, extra_stop_token_ids: Sequence[int] = ()) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{path}: unreadable tokenizer: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = _chat_template_of(config, folder)
        specials = {k: _token_string(config.get(k)) for k in ("unk_token", "pad_token") if config.get(k)}
        return cls(
            backend,
            bos_token=_token_string(config.get("bos_token")),
            eos_token=_token_string(config.get("eos_token")),
            chat_template=template,
            extra_stop_token_ids=extra_stop_token_ids,
            special_tokens=specials,
        )

    @classmethod
    def from_gguf(cls, checkpoint: Any, extra_stop_token_ids: Sequence[int] = ()) -> Tokenizer:
        """From the metadata of a `GGUFCheckpoint`: byte-level BPE ("gpt2": Llama 3, Qwen2, SmolLM2)
        or sentencepiece BPE ("llama": Llama 2, Mistral), merges rebuilt from the scores."""
        meta = checkpoint.metadata
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens") or []
        token_types: list[int] = checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or len(token_types) != len(tokens):
            raise TokenizerError("GGUF vocabulary missing, or its token types do not match it")
        if kind == "gpt2":
            merges = checkpoint.field("tokenizer.ggml.merges") or []
            backend = _gguf_byte_level_backend(tokens, merges, token_types, meta)
        elif kind == "llama":
            scores = checkpoint.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend = _gguf_sentencepiece_backend(tokens, scores, token_types, meta)
        else:
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported ('gpt2' or 'llama')")

        def token_of(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

        specials = {"unk_token": token_of("unknown_token_id"), "pad_token": token_of("padding_token_id")}
        return cls(
            backend,
            bos_token=token_of("bos_token_id"),
            eos_token=token_of("eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_stop_token_ids=extra_stop_token_ids,
            special_tokens={k: v for k, v in specials.items() if v is not None},
        )

    # ---- encode / decode ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level spelling, e.g. 'Ġworld'), None if out of range."""
        return self.backend.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in token_ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def all_special_ids(self) -> set[int]:
        ids = (
            self.backend.token_to_id(t.content)
            for t in self.backend.get_added_tokens_decoder().values()
            if t.special
        )
        return {i for i in ids if i is not None}

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages ([{"role", "content"}, ...]) with the model's Jinja template to a prompt string."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        context = {k: v for k, v in self._special_tokens.items() if v is not None}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context, **kwargs
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """`kwargs`: more template variables (e.g. `tools`)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )


def _gguf_byte_level_backend(
    tokens: list[str], merges: list[str], token_types: list[int], meta: dict[str, Any]
) -> BackendTokenizer:
    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # Control tokens (e.g. <|im_end|>) stay whole and are skipped by decode(skip_special_tokens);
    # a "control" token outside the byte alphabet is a llama.cpp mislabel and is left alone.
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED
    ]
    backend.add_special_tokens(specials)
    backend.add_tokens(user)
    steps = [processors.ByteLevel(trim_offsets=False), *_bos_processor(tokens, meta, default=False)]
    backend.post_processor = processors.Sequence(steps)
    return backend


def _bos_processor(tokens: list[str], meta: dict[str, Any], default: bool) -> list[processors.PostProcessor]:
    """Prepend BOS when the file asks for it (llama.cpp adds it to sentencepiece vocabularies by default)."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", default) or bos_id is None:
        return []
    bos = tokens[int(bos_id)]
    return [
        processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    ]


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens,
    best score first (the order transformers' `generate_merges` uses)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_sentencepiece_backend(
    tokens: list[str], scores: list[float], token_types: list[int], meta: dict[str, Any]
) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if len(scores) != len(tokens):
        raise TokenizerError("GGUF sentencepiece scores do not match the vocabulary")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores),
        unk_token=None if unk_id is None else tokens[int(unk_id)],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        [*steps, *([decoders.Strip(content=" ", left=1)] if add_prefix else [])]
    )
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind in (_CONTROL, _UNKNOWN)
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _USER_DEFINED
        ]
    )
    steps = _bos_processor(tokens, meta, default=True)
    backend.post_processor = processors.Sequence(steps) if steps else None
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: unreadable JSON: {exc}") from exc


def _chat_template_of(config: dict[str, Any], folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim/lstrip blocks, loop controls, its helper globals."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"invalid chat template: {exc}") from exc
