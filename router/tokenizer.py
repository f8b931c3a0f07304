"""The Hugging Face tokenizer a local checkpoint directory ships: text to token ids and back, token by
token while streaming, and its chat template.

`tokenizer.json` is read with the `tokenizers` package; `tokenizer_config.json` (or
`chat_template.jinja`) supplies the chat template and its special tokens. Presets with random
weights ship none: the front end then takes token-id prompts only.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

CONTEXT_TOKENS = 5     # prompt tokens decoded ahead of the output, so its first piece keeps its spacing


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; the message names the file."""


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: cannot load: {e}") from None
        config = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{config_path}: cannot read: {e}") from None
        template = config.get("chat_template")
        if isinstance(template, list):   # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.exists():
            template = jinja_path.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of a conversation, ending where the assistant's reply begins."""
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "")

    def detokenizer(self, prompt_ids: list[int]) -> "Detokenizer":
        return Detokenizer(self, prompt_ids)


class Detokenizer:
    """Text of a growing list of output tokens, one piece per token.

    Each piece is decode(window + new) minus decode(window) over a short sliding window that starts in
    the prompt, so word boundaries and spaces come out as a whole decode would give them; a piece that
    ends inside a multi-byte character (decoded as U+FFFD) is held until the character is complete."""

    def __init__(self, tok: TextTokenizer, prompt_ids: list[int]):
        self.tok = tok
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0                  # the window: ids[prefix:read] is already text
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._piece(final=False)

    def flush(self) -> str:
        """Whatever is held back (the output ended inside a character)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def load_tokenizer(checkpoint: str | None) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when there is no checkpoint or it ships no tokenizer.json."""
    if checkpoint is None or not (Path(checkpoint) / "tokenizer.json").exists():
        return None
    return TextTokenizer(checkpoint)
