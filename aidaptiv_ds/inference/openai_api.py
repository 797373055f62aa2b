"""The OpenAI HTTP API's shapes, as the ``openai`` client, LangChain, Open WebUI and editors' assistants speak them:
requests checked into :class:`Ask` (every problem said in the API's error shape, naming the field), and the
objects of /v1/models, /v1/completions and /v1/chat/completions, whole or as server-sent event chunks.

What is taken: ``model`` (the served name), ``prompt`` (a string or a list of one) or ``messages``,
``max_tokens`` / ``max_completion_tokens``, ``temperature`` (0: greedy), ``top_p``, ``seed``, ``stream``, ``n``
(1 only), ``stop`` (strings that end the reply), ``user``. Other fields the API defines (logprobs, tools,
response_format, penalties) are refused by name rather than ignored, so a client never believes they applied.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Union

# Fields a request may carry that change nothing here (metadata, or defaults we follow).
_HARMLESS = {"user", "metadata", "store", "stream_options", "n", "frequency_penalty", "presence_penalty"}
_REFUSED = {
    "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice", "functions",
    "function_call", "response_format", "parallel_tool_calls", "audio", "modalities", "prediction",
}  # fmt: skip


class APIError(Exception):
    """A request refused in the API's error shape: HTTP ``status``, ``message``, the offending ``param``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Ask:
    """One request, checked: what to generate and how."""

    chat: bool
    prompt: Union[str, List[dict]]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stream: bool
    stop: List[str] = field(default_factory=list)
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _number(body: dict, name: str, default, lo, hi, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not (lo <= value <= hi):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind} from {lo} to {hi}, got {value!r}", name)
    return value


def parse(body, chat: bool, served: str, max_tokens_default: int, context: Optional[int]) -> Ask:
    """A request body checked into an :class:`Ask` (APIError naming the first bad field)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k in _REFUSED)
    if unknown:
        raise APIError(400, f"'{unknown[0]}' is not supported by this server (it generates text only)", unknown[0])
    model = body.get("model")
    if model not in (served, None) and model != "":
        raise APIError(
            404,
            f"model '{model}' is not served here: this server serves '{served}' (GET /v1/models)",
            "model",
            "not_found_error",
        )
    if body.get("n", 1) != 1:
        raise APIError(400, "'n' must be 1: one reply a request", "n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
        prompt = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: the text ones, joined (images are refused)
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p.get("text", "") for p in content)
            if not (
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant", "developer")
                and isinstance(content, str)
            ):
                raise APIError(400, f"messages[{i}] must be {{role: system|user|assistant, content: text}}", "messages")
            prompt.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise APIError(400, "'prompt' must be a non-empty string (one prompt a request)", "prompt")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = context or 1 << 20
    max_tokens = _number(body, name, max_tokens_default, 1, limit, integer=True)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    options = body.get("stream_options") or {}
    return Ask(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=float(_number(body, "top_p", 1.0, 0, 1)),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        stream=bool(body.get("stream", False)),
        stop=stop,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def cut_at_stop(text: str, stop: List[str]) -> tuple:
    """(text up to the first stop string, whether one was found)."""
    at = min((text.find(s) for s in stop if s in text), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def models(served: str, created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": served, "object": "model", "created": created, "owned_by": "aidaptiv-ds"}],
    }


def usage(prompt_tokens: int, new_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": new_tokens, "total_tokens": prompt_tokens + new_tokens}


def whole(ask: Ask, served: str, text: str, finish: str, prompt_tokens: int, new_tokens: int) -> dict:
    """The response to a request without ``stream``."""
    if ask.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + ask.id,
        "object": kind,
        "created": ask.created,
        "model": served,
        "choices": [choice],
        "usage": usage(prompt_tokens, new_tokens),
    }


def chunk(ask: Ask, served: str, piece: Optional[str], finish: Optional[str] = None, first: bool = False) -> str:
    """One server-sent event of a streamed reply (``data: {...}`` and a blank line)."""
    if ask.chat:
        delta = {"role": "assistant", "content": piece or ""} if first else ({"content": piece} if piece else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        kind, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        kind, prefix = "text_completion", "cmpl-"
    obj = {"id": prefix + ask.id, "object": kind, "created": ask.created, "model": served, "choices": [choice]}
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_chunk(ask: Ask, served: str, prompt_tokens: int, new_tokens: int) -> str:
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if ask.chat else ("text_completion", "cmpl-")
    obj = {"id": prefix + ask.id, "object": kind, "created": ask.created, "model": served, "choices": [],
           "usage": usage(prompt_tokens, new_tokens)}  # fmt: skip
    return f"data: {json.dumps(obj)}\n\n"
