"""A request's fields, checked by name and type before anything runs (a field this server does
not implement is refused, never ignored), and the sampling settings they ask for; OpenAI's
error object for whatever is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_TOKENS = 16     # /v1/completions, as OpenAI's
MAX_N = 16


class ApiError(Exception):
    """An OpenAI-style error: status, message, the parameter at fault, its type and code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


# -- the fields of a request --------------------------------------------------------------------

_NUMBER = (int, float)
COMMON = {"model": str, "max_tokens": int, "temperature": _NUMBER, "top_p": _NUMBER,
          "top_k": int, "seed": int, "stop": (str, list), "n": int, "stream": bool,
          "stream_options": dict, "user": str, "frequency_penalty": _NUMBER,
          "presence_penalty": _NUMBER}
CHAT = {**COMMON, "messages": list, "max_completion_tokens": int, "logprobs": bool,
        "top_logprobs": int}
COMPLETION = {**COMMON, "prompt": (str, list), "logprobs": int, "echo": bool,
              "suffix": str, "best_of": int}


@dataclass
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None      # top alternatives per token (0: only the chosen); None: no logprobs


def check_fields(body: Any, allowed: dict, required: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name, value in body.items():
        if name not in allowed:
            raise ApiError(f"{name}: not supported by this server", name,
                           code="unsupported_parameter")
        kind = allowed[name]
        if value is None:
            continue
        if isinstance(value, bool) and kind is not bool and bool not in _tuple(kind):
            raise ApiError(f"{name}: expected {_kind_name(kind)}, got a boolean", name)
        if not isinstance(value, kind):
            raise ApiError(f"{name}: expected {_kind_name(kind)}, got {type(value).__name__}",
                           name)
    for name in required:
        if body.get(name) is None:
            raise ApiError(f"{name}: required", name)
    return body


def _tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", bool: "a boolean"}
    return " or ".join(dict.fromkeys(names[k] for k in _tuple(kind)))


def sampling(body: dict, max_tokens_default: int | None, logprobs: int | None) -> Sampling:
    """The generation settings of a checked request body."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            raise ApiError(f"{name}: not supported by this server (only 0)", name,
                           code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens is not None and max_tokens < 0:
        raise ApiError(f"max_tokens: must be >= 0 (got {max_tokens})", "max_tokens")
    temperature = float(1.0 if body.get("temperature") is None else body["temperature"])
    if not 0 <= temperature <= 2:
        raise ApiError(f"temperature: must be in [0, 2] (got {temperature})", "temperature")
    top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p: must be in (0, 1] (got {top_p})", "top_p")
    top_k = body.get("top_k") or 0
    if top_k < 0:
        raise ApiError(f"top_k: must be >= 0 (got {top_k})", "top_k")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
        raise ApiError("stop: at most 4 non-empty strings", "stop")
    n = 1 if body.get("n") is None else body["n"]
    if not 1 <= n <= MAX_N:
        raise ApiError(f"n: must be in [1, {MAX_N}] (got {n})", "n")
    options = body.get("stream_options") or {}
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False),
                                                          bool):
        raise ApiError("stream_options: only include_usage (a boolean) is supported",
                       "stream_options")
    if options and not body.get("stream"):
        raise ApiError("stream_options: only with stream", "stream_options")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                    seed=body.get("seed"), stops=stops, n=n, stream=bool(body.get("stream")),
                    include_usage=bool(options.get("include_usage")), logprobs=logprobs)
