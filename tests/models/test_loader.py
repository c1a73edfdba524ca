"""Loader errors name the problem and what to do; the cache root follows argument, env, default."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from blockserve.attention.paged_attention import BACKENDS
from blockserve.models import loader
from blockserve.models.default_model import INSTALL_COMMAND, default_model_path
from blockserve.models.loader import load_model
from blockserve.models.registry import model_class

EXACT = BACKENDS["exact"]


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass a Hugging Face model directory"):
        load_model(str(tmp_path / "nowhere"), EXACT)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path), EXACT)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \(GPT2LMHeadModel\).*LlamaForCausalLM"):
        load_model(str(tmp_path), EXACT)


def test_registry_without_architectures():
    with pytest.raises(ValueError, match=r"\(none listed\); blockserve supports: .*LlamaForCausalLM"):
        model_class(None)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_model(str(tmp_path), EXACT)


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="corrupt weights file .*model.safetensors"):
        load_model(str(tmp_path), EXACT)


def test_neither_directory_nor_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf file"):
        load_model(str(tmp_path / "weights.bin"), EXACT)


@pytest.mark.parametrize("content", [b"this is not a gguf file", "truncated"])
def test_corrupt_gguf(tmp_path, content):
    if content == "truncated":
        with open(default_model_path(), "rb") as f:
            content = f.read(1 << 20)
    (tmp_path / "model.gguf").write_bytes(content)
    with pytest.raises(ValueError, match="could not read GGUF file .*truncated or corrupt"):
        load_model(str(tmp_path / "model.gguf"), EXACT, cache_dir=str(tmp_path / "cache"))
    # refused before the cache is touched: nothing left behind
    assert not (tmp_path / "cache").exists()


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=f"install it with `{INSTALL_COMMAND}`"):
        load_model(None, EXACT)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("BLOCKSERVE_CACHE_DIR", raising=False)
    assert loader.cache_root() == Path.home() / ".cache" / "blockserve"
    monkeypatch.setenv("BLOCKSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert loader.cache_root() == tmp_path / "env"
    assert loader.cache_root(str(tmp_path / "arg")) == tmp_path / "arg"


def test_cache_entry_follows_the_content_not_the_path(tmp_path):
    gguf, copy = tmp_path / "m.gguf", tmp_path / "elsewhere" / "m.gguf"
    gguf.write_bytes(b"a")
    copy.parent.mkdir()
    copy.write_bytes(b"a")
    before = loader.gguf_cache_entry(gguf, tmp_path)
    assert loader.gguf_cache_entry(copy, tmp_path) == before
    os.utime(gguf, ns=(0, 0))  # touched: read again, same content
    assert loader.gguf_cache_entry(gguf, tmp_path) == before
    gguf.write_bytes(b"b")
    assert loader.gguf_cache_entry(gguf, tmp_path) != before
    assert loader.gguf_cache_entry(copy, tmp_path) == before


def test_a_read_only_cache_still_names_its_entries(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"a")
    entry = loader.gguf_cache_entry(gguf, tmp_path / "writable")

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(loader.tempfile, "mkstemp", read_only)
    assert loader.gguf_cache_entry(gguf, tmp_path / "read-only").name == entry.name


def test_a_damaged_digest_memo_is_read_again(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"a")
    entry = loader.gguf_cache_entry(gguf, tmp_path)
    (memo,) = (tmp_path / "sources").iterdir()
    memo.write_text("../../etc")
    assert loader.gguf_cache_entry(gguf, tmp_path) == entry


def test_every_registered_architecture_resolves_to_a_causal_lm():
    from blockserve.models.base import CausalLM
    from blockserve.models.registry import ARCHITECTURES

    for name in ARCHITECTURES:
        cls = model_class([name])
        assert issubclass(cls, CausalLM) and cls.__name__ in (name, "LlamaForCausalLM"), name
