"""A small word-level tokenizer, built with the `tokenizers` library and saved as a Hugging Face
tokenizer directory (tokenizer.json, tokenizer_config.json with a chat template): for the tests and
the benchmark of the server on models with random weights, which ship none.

Every word is one token (unknown words are <unk>), so a prompt of N words is N tokens plus <s>, and
every generated token decodes to one word.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

SPECIAL = ["<unk>", "<s>", "</s>"]                 # ids 0, 1, 2: Llama's unk, bos and eos
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have this from or "
         "had by hot word but what some we can out other were all there when up use your how said an each she "
         "which do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find any new work part take get place made live where after back "
         "little only round man year came show every good me give our under name very through just form "
         "sentence great think say help low line differ turn cause much mean before move right boy old too same "
         "tell does set three want air well also play small end put home read hand port large spell add even "
         "land here must big high such follow act why ask men change went light kind off need house picture try "
         "us again animal point mother world near build self earth father").split()
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build(vocab_size: int) -> Tokenizer:
    words = [w for w in dict.fromkeys(WORDS + [".", ",", "?", "!"])]
    words += [f"w{i}" for i in range(vocab_size)]
    vocab = {t: i for i, t in enumerate((SPECIAL + ROLES + words)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
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
