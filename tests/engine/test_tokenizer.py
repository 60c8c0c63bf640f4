"""Our tokenizer (from GGUF metadata, and from a Hugging Face folder) against transformers'."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedinfer.engine.models.builtin import BUILTIN_MODELS
from pagedinfer.engine.models.gguf_loader import GGUFCheckpoint
from pagedinfer.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "  leading spaces\n\nand blank lines\t\ttabs  ",
    "héllo wörld — naïve café, 你好，世界! 🤖🚀 ∑x²",
    "Ελληνικά и русский текст, עברית, العربية",
    "x = 3.14159; y = 1e-9 ** 2 # 2024-12-02",
    "don't I'll we've they're",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a" * 60 + " 12345678901234567890",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color. 🎨"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in français?"},
    ],
]


def _gguf_path() -> Path:
    entry = BUILTIN_MODELS["smollm2-135m"]
    folder = next(iter(importlib.util.find_spec(entry.package).submodule_search_locations))
    return Path(folder) / entry.filename


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFCheckpoint(_gguf_path()))


@pytest.fixture(scope="module")
def hf():
    path = _gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_plain_text_round_trips(ours):
    for text in TEXTS:
        if "<|" not in text:
            assert ours.decode(ours.encode(text)) == text


def test_digits_are_split_singly_like_llama_cpp_smollm(ours):
    ids = ours.encode("2024")
    assert [ours.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, hf, messages):
    for add in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=add)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode_chat(messages) == list(expected)


def test_special_ids(ours, hf):
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.stop_token_ids == (2,)
    assert ours.vocab_size == len(hf) == 49152
    assert {1, 2} <= ours.all_special_ids
    assert ours.id_to_token(10**6) is None


def test_from_pretrained_folder_matches_transformers(ours, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    folder_tok = Tokenizer.from_pretrained(tmp_path, extra_stop_token_ids=[2, 0])
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert folder_tok.encode(text) == reloaded.encode(text)
    messages = CONVERSATIONS[1]
    assert folder_tok.apply_chat_template(messages) == reloaded.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert folder_tok.stop_token_ids == (2, 0)


def test_missing_or_broken_template_is_a_typed_error(ours, tmp_path):
    bare = Tokenizer(ours.backend, bos_token=None, eos_token=None, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(
        ours.backend,
        bos_token=None,
        eos_token=None,
        chat_template="{{ raise_exception('roles must alternate') }}",
    )
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_pretrained(tmp_path)


SPM_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "a", "n", "i", "s", "c", "f", "é", "▁t", "he"]
SPM_PIECES += ["▁the", "ll", "llo", "▁he", "▁hello", "▁w", "or", "ld", "▁world", "in", "▁in", "is", "▁is"]
SPM_PIECES += ["▁a", "an", "▁an", "▁c", "af", "▁caf", "▁café", "▁▁", "▁▁▁▁"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A tiny sentencepiece-style ("llama") GGUF vocabulary: scores, byte tokens, no merges."""
    import gguf

    folder = tmp_path_factory.mktemp("spm")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SPM_PIECES]
    writer = gguf.GGUFWriter(folder / "spm.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / "spm.gguf"


@pytest.mark.parametrize(
    "text",
    ["hello world", " hello  world", "the café is in a", "hello\nworld ü 😀", "", "</s>hello<s> world"],
)
def test_sentencepiece_gguf_matches_transformers(spm_gguf, text):
    ours = Tokenizer.from_gguf(GGUFCheckpoint(spm_gguf))
    hf = transformers.AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    ids = ours.encode(text)
    assert ids == hf.encode(text) and ids[0] == ours.bos_token_id == 1  # BOS by default, like llama.cpp
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
