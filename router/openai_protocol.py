"""The OpenAI HTTP API's shapes: request bodies in, errors and response bodies out.

Parsing here only reads the API's fields (types of `prompt`, `messages`, `stop`, `stream`, ...) and
maps them onto the engine's sampling fields; whether a value is allowed (max_tokens, temperature,
top_p, seed, stop_token_ids, ignore_eos, token ids, lengths) is decided by the one set of rules in
workers/request.py, which the router applies at submit. Fields the engine cannot honour are accepted
at their neutral value and refused otherwise, naming the field.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

MAX_STOP_STRINGS = 16
NEUTRAL = {   # field -> values that ask for nothing the engine would have to do
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "top_k": (None, -1, 0), "min_p": (None, 0), "repetition_penalty": (None, 1), "min_tokens": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "skip_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False), "spaces_between_special_tokens": (None, True),
}
IGNORED = {"user", "metadata", "store", "service_tier"}      # no effect on what is generated
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
          "stop_token_ids", "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}


class APIError(Exception):
    """An error answered in the OpenAI format: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, admitted: bool = False):
        """`admitted`: the request had been admitted (it failed, rather than being refused)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = status, message, param, code, retry_after_s
        self.admitted = admitted

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def param_of(reason: str) -> str | None:
    """The API field a rejection from workers/request.py (or the router's never-fit check) is about."""
    if "+ max_tokens" in reason:
        return "max_tokens"
    m = re.match(r"(?:can never fit: |empty prompt: )?(?:one layer of its |its )?([a-z_]+)", reason)
    if m is None:
        return None
    name = m.group(1)
    return "prompt" if name in ("prompt", "prompt_ids", "prompt's") else name


@dataclass
class Generation:
    """One parsed request: what to submit, and how to answer."""

    kind: str                    # completion | chat
    prompt_ids: list[int]
    params: dict                 # the engine's sampling fields (checked by workers/request.py at submit)
    stop: tuple[str, ...]        # stop strings, matched on the output text by the front end
    stream: bool
    include_usage: bool          # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool       # stream_options.continuous_usage_stats: usage on every chunk


def _same(value, neutral) -> bool:
    """Equal and of the same kind: true is not 1, 0.0 is 0."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return value == neutral


def check_fields(body, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in known or key in IGNORED:
            continue
        if key not in NEUTRAL:
            raise bad(key, f"unknown field {key!r}")
        if not any(_same(value, v) for v in NEUTRAL[key]):
            raise bad(key, f"{key}={value!r} is not supported by this server (only {NEUTRAL[key][1]!r})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "required: the name of the served model (GET /v1/models)")
    return body


def _stream_options(body: dict) -> tuple[bool, bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream={stream!r} must be true or false")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad("stream_options", "takes include_usage and continuous_usage_stats (true or false)")
    if not stream:
        raise bad("stream_options", "only allowed with stream=true")
    usage, continuous = opts.get("include_usage") or False, opts.get("continuous_usage_stats") or False
    if not isinstance(usage, bool) or not isinstance(continuous, bool):
        raise bad("stream_options", "include_usage and continuous_usage_stats must be true or false")
    return stream, usage, continuous


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    return tuple(stops)


def sampling(body: dict, max_tokens, default_temperature: float = 1.0) -> dict:
    """The engine's sampling fields, defaulted as the OpenAI API defaults them; values unchecked."""
    stop_ids = body.get("stop_token_ids")
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    return {"max_tokens": max_tokens, "temperature": default_temperature if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p, "seed": body.get("seed"),
            "stop_token_ids": [] if stop_ids is None else stop_ids,
            "ignore_eos": False if body.get("ignore_eos") is None else body["ignore_eos"]}


def completion_prompt(prompt, tokenizer, model_name: str) -> list[int]:
    """`prompt` as OpenAI allows it (text, token ids, or a batch of one of either) -> token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"a batch of {len(prompt)} prompts; send one request per prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad("prompt", f"model {model_name!r} ships no tokenizer (tokenizer.json), so it takes token-id "
                                "prompts only: send prompt as a list of integers")
        if not prompt:
            raise bad("prompt", "empty prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return prompt                                        # ids: checked by workers/request.py
    raise bad("prompt", "required: a string, or a list of token ids")


def chat_prompt(messages, tokenizer, model_name: str) -> list[int]:
    if tokenizer is None or tokenizer.chat_template is None:
        raise bad("messages", f"model {model_name!r} has no chat template (tokenizer_config.json); use "
                              "/v1/completions")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content}")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        plain.append({"role": m["role"], "content": content or ""})
    try:
        text = tokenizer.render_chat(plain)
    except Exception as e:   # the template refused the conversation (e.g. roles out of order)
        raise bad("messages", f"the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def parse_completion(body, tokenizer, model_name: str) -> Generation:
    body = check_fields(body, COMPLETION_FIELDS)
    stream, usage, continuous = _stream_options(body)
    prompt_ids = completion_prompt(body.get("prompt"), tokenizer, model_name)
    max_tokens = 16 if body.get("max_tokens") is None else body["max_tokens"]   # OpenAI's default
    return Generation("completion", prompt_ids, sampling(body, max_tokens), _stop(body), stream, usage, continuous)


def parse_chat(body, tokenizer, model_name: str, max_model_len: int) -> Generation:
    body = check_fields(body, CHAT_FIELDS)
    stream, usage, continuous = _stream_options(body)
    prompt_ids = chat_prompt(body.get("messages"), tokenizer, model_name)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:                       # the rest of the context
        max_tokens = max(1, max_model_len - len(prompt_ids))
    return Generation("chat", prompt_ids, sampling(body, max_tokens), _stop(body), stream, usage, continuous)


# -- responses ---------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(kind: str, text: str, token_ids: list[int], finish_reason: str | None, stream: bool,
           first: bool = False) -> dict:
    if kind == "completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
    if stream:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason, "token_ids": token_ids}


def envelope(kind: str, rid: str, model: str, created: int, choices: list[dict], stream: bool) -> dict:
    obj = "text_completion" if kind == "completion" else ("chat.completion.chunk" if stream else "chat.completion")
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def model_list(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pdlab",
                                        "root": name, "max_model_len": max_model_len}]}


def now() -> int:
    return int(time.time())
