"""A small generated tokenizer, built with the `tokenizers` library and saved as a Hugging Face
tokenizer directory (tokenizer.json, tokenizer_config.json with a chat template): for the tests and
the benchmark of the server on models with random weights, which ship none.

Text is encoded one character per token (printable ASCII; any other character is <unk>), so every
prompt round-trips exactly and a client counting tokens with this tokenizer counts what the server
does. The rest of the vocabulary is words: whatever id a random model samples decodes to some text.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, processors

SPECIAL = ["<unk>", "<s>", "</s>"]                 # ids 0, 1, 2: Llama's unk, bos and eos
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list(string.printable[:95]) + ["\n"]      # letters, digits, punctuation, space; newline
WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have this from or "
         "had by hot word but what some we can out other were all there when up use your how said an each she "
         "which do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find any new work part take get place made live where after back "
         "little only round man year came show every good me give our under name very through just form").split()
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build(vocab_size: int) -> Tokenizer:
    """`vocab_size` ids: specials, roles, characters, then " word" tokens (numbered once the list runs out)."""
    fill = [f" {w}" for w in WORDS] + [f" w{i}" for i in range(vocab_size)]
    tokens = list(dict.fromkeys(SPECIAL + ROLES + CHARS + fill))[:vocab_size]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()                  # tokens are pieces of text: join them as they are
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False) for t in ROLES])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def save(directory: str | Path, vocab_size: int) -> Path:
    """Write the tokenizer files into `directory` (a checkpoint's, or one of its own)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build(vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}, indent=2))
    return directory
