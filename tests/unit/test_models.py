"""Bundled models build offline, into an empty cache, and load back fast."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """verifier.models with its cache pointed at an empty folder (CI's cache may be warm)."""
    monkeypatch.setenv("PRIME_CACHE_DIR", str(tmp_path))
    import verifier.models

    yield importlib.reload(verifier.models)
    monkeypatch.delenv("PRIME_CACHE_DIR")
    importlib.reload(verifier.models)


def test_tiny_model_is_deterministic_and_char_level(fresh_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    from verifier.models import load_tokenizer

    a = fresh_cache.build_tiny_model(tmp_path / "a", seed=3)
    b = fresh_cache.build_tiny_model(tmp_path / "b", seed=3)
    ma, mb = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (a, b))
    assert all(
        torch.equal(x, y)
        for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True)
    )
    tok = load_tokenizer(a)
    text = "hello world, 42!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # spaces survive
    assert len(tok.encode(text, add_special_tokens=False)) == len(text)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


@pytest.mark.slow
def test_smollm2_dequantizes_from_the_pypi_package_into_an_empty_cache(fresh_cache):
    from transformers import AutoConfig

    path = fresh_cache.smollm2_path()
    assert path.parent.parent == fresh_cache.CACHE_DIR
    cfg = AutoConfig.from_pretrained(str(path))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert not hasattr(cfg, "quantization_config")
    files = list(path.glob("*.safetensors"))
    assert files and sum(f.stat().st_size for f in files) < 300e6  # bf16, not packed Q4
    assert fresh_cache.smollm2_path() == path  # cached: second call does not rebuild
