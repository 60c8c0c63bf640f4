"""load_model: safetensors folders (single and sharded), hf:// from a local cache, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import hf_logits
from safetensors.torch import load_file, save_file

from pagedinfer._native import BlockManager
from pagedinfer.engine.models.builtin import CheckpointFormat, resolve_model_uri
from pagedinfer.engine.models.errors import ModelLoadError, UnsupportedModelError
from pagedinfer.engine.models.loader import load_model, resolve_dtype
from pagedinfer.engine.models.testing import PagedRunner


def _copy(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def _logits(folder, tokens):
    loaded = load_model(str(folder), "cpu", torch.float32)
    runner = PagedRunner(loaded.model, BlockManager(8, 16, True), 8, 16)
    runner.add(0, tokens)
    return runner.step([0], [len(tokens)])


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    hf, folder = tiny_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = list(range(3, 40))
    ours = _logits(sharded, tokens)
    assert torch.equal(ours, _logits(folder, tokens))
    assert (ours - hf_logits(hf, tokens)).abs().max() <= 1e-4


def test_missing_shard_is_named(tiny_checkpoint, tmp_path, no_allocation):
    hf, _ = tiny_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(str(sharded), "cpu", torch.float32)


def test_unsupported_architecture(tiny_checkpoint, tmp_path, no_allocation):
    folder = _copy(tiny_checkpoint("llama-gqa")[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(str(folder), "cpu", torch.float32)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors.*layers.1.mlp.up_proj"),
        (
            lambda w: w.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)),
            r"k_proj.weight.*model.safetensors has shape \(16, 64\), expected \(32, 64\)",
        ),
        (lambda w: w.__setitem__("model.layers.0.extra.weight", torch.zeros(2)), "unexpected tensors"),
        (lambda w: w.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int8)), "dtype I8"),
    ],
    ids=["missing", "shape", "unexpected", "dtype"],
)
def test_bad_tensors_are_rejected_before_allocation(tiny_checkpoint, tmp_path, no_allocation, edit, match):
    folder = _copy(tiny_checkpoint("llama-gqa")[1], tmp_path)
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(folder), "cpu", torch.float32)


def test_bad_config_values(tiny_checkpoint, tmp_path, no_allocation):
    folder = _copy(tiny_checkpoint("llama-gqa")[1], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for key, value, match in [
        ("num_key_value_heads", 3, "not a multiple"),
        ("hidden_act", "gelu", "activation"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope type 'yarn'"),
        ("quantization_config", {"quant_method": "awq"}, "awq"),
    ]:
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(folder), "cpu", torch.float32)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: unreadable JSON"):
        load_model(str(folder), "cpu", torch.float32)


@pytest.mark.parametrize(
    "uri, match",
    [
        ("/no/such/model", "no such file"),
        ("s3://bucket/model", "unknown URI scheme"),
        ("builtin://llama-70b", "unknown builtin model"),
        ("hf://just-a-name", "expected hf://org/name"),
    ],
)
def test_bad_uris(uri, match):
    with pytest.raises(ModelLoadError, match=match):
        resolve_model_uri(uri)


def test_not_a_gguf_file(tmp_path, no_allocation):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="model.gguf: not a readable GGUF file: bad magic"):
        load_model(str(bogus), "cpu", torch.float32)


def _fake_hub_cache(cache, repo_id, folder, commit="0123456789abcdef0123456789abcdef01234567"):
    """The on-disk layout huggingface_hub's cache uses: refs/main -> snapshots/<commit>/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return commit


def test_hf_uri_from_local_cache_offline(tiny_checkpoint, tmp_path):
    hf, folder = tiny_checkpoint("llama-gqa")
    commit = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", folder)
    for uri in (
        "hf://tiny-org/tiny-llama",
        "hf://tiny-org/tiny-llama@main",
        f"hf://tiny-org/tiny-llama@{commit}",
    ):
        loaded = load_model(uri, "cpu", "float32", download_dir=tmp_path / "hub", local_files_only=True)
        assert loaded.source_path.name == commit and loaded.model_config.architecture == "llama"
    with pytest.raises(ModelLoadError, match="cannot fetch"):
        load_model(
            "hf://tiny-org/absent", "cpu", "float32", download_dir=tmp_path / "hub", local_files_only=True
        )


def test_hf_gguf_file_uri_from_local_cache(tmp_path):
    from gguf_tiny import write_gguf
    from hf_tiny import build_hf_model

    model_dir = tmp_path / "repo"
    model_dir.mkdir()
    write_gguf(model_dir / "tiny-q8.gguf", build_hf_model("llama-gqa"))
    _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-gguf", model_dir)
    uri = "hf://tiny-org/tiny-gguf/tiny-q8.gguf@main"
    loaded = load_model(uri, "cpu", "float32", download_dir=tmp_path / "hub", local_files_only=True)
    assert loaded.source_path.name == "tiny-q8.gguf" and loaded.model_config.num_layers == 2
    with pytest.raises(ModelLoadError, match="must be a .gguf"):
        resolve_model_uri("hf://tiny-org/tiny-gguf/weights.bin")


def test_resolution_kinds(tiny_checkpoint):
    folder = tiny_checkpoint("llama-gqa")[1]
    assert resolve_model_uri(str(folder)).format is CheckpointFormat.SAFETENSORS
    builtin = resolve_model_uri("builtin://smollm2-135m")
    assert builtin.format is CheckpointFormat.GGUF and builtin.path.name.endswith(".gguf")
    assert resolve_model_uri(str(builtin.path.parent)).format is CheckpointFormat.GGUF


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", "cpu")
