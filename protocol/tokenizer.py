"""The trusted side's tokenizer: chat template, encode, decode, without torch or transformers.

The scheduler's OpenAI front tokenizes every prompt it sends to a worker, and the
orchestrator decodes what the rubric scores, from the verified token ids, with this class.
It reads a Hugging Face model folder (`tokenizer.json`, `tokenizer_config.json`, and the
chat template from `chat_template.jinja` or the config) with the `tokenizers` library and
renders the chat template with jinja2 the way transformers' `apply_chat_template` does
(sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`), so a prompt gets
the same ids here as on a node.

Invariants: the ids of a chat prompt are those of the rendered template encoded without
added special tokens (the template writes them); decoding skips special tokens, so the
text a client or a rubric sees never carries `<|im_end|>`; a folder without a
`tokenizer.json` is refused at load with a message that says what is missing.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer folder or a chat that cannot be used; the message says why."""


def _raise(message: str) -> None:
    raise TokenizerError(f"chat template refused the conversation: {message}")


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


class ChatTokenizer:
    def __init__(self, folder: Path | str):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        folder = Path(folder).expanduser()
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{folder} has no tokenizer.json: give a Hugging Face model folder"
            )
        self.folder = folder
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template_file = folder / "chat_template.jinja"
        template = (
            template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        )
        self.special = {
            name: _token_text(cfg.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.template = None
        if isinstance(template, str) and template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self.template = env.from_string(template)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def chat_ids(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        if self.template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        text = self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without added special tokens (as the node's completions)."""
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
                text = text.replace(a, b)
            for a, b in ((" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve")):
                text = text.replace(a, b)
            text = text.replace(" 're", "'re")
        return text

    def token_text(self, token_id: int) -> str:
        """The text of one token as a client sees it in logprobs (special tokens included)."""
        return self.tok.decode([token_id], skip_special_tokens=False)
