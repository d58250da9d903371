"""`jax-llama serve`: an OpenAI-compatible HTTP server over jax_llama.serving's batching engine.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the
model's own chat template), and vLLM's /tokenizer_info, /tokenize and /detokenize, through which
lm-evaluation-harness' `local-completions` tokenizes as the server does.

Every request's fields are checked by name and type before anything runs: a field this server
does not implement is refused (400), never ignored. Stop strings are cut on the text
(bridge.prompts.TextStream): never returned, never partly streamed. Streams are Server-Sent
Events, `data: {...}` chunks, the last of each choice with its finish_reason, then `data: [DONE]`.
A client that goes away mid-stream cancels its rows, which the next request then takes.

The app is Starlette's (FastAPI's base); uvicorn runs it. Both are in the [serve] extra.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from bridge.errors import BridgeError
from bridge.prompts import TextStream

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


# -- the server ---------------------------------------------------------------------------------

class Server:
    """The endpoints' logic over an engine (jax_llama.serving.Engine), a tokenizer and a chat
    template; the HTTP app (app()) only moves JSON in and out."""

    def __init__(self, engine, model, params, tokenizer, template, name: str,
                 api_key: str | None = None):
        self.engine, self.model, self.params = engine, model, params
        self.tokenizer, self.template, self.name, self.api_key = tokenizer, template, name, api_key
        self.stop_ids = tuple(tokenizer.stop_ids)
        self.created = int(time.time())

    # -- prompts

    def _check_model(self, body: dict) -> None:
        if body["model"] != self.name:
            raise ApiError(f"model: {body['model']!r} is not served here (this server serves "
                           f"{self.name!r})", "model", status=404, code="model_not_found")

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """A string, a list of strings, a list of ids, or a list of lists of ids -> id lists
        (self._texts: the text each came from, or None for ids; what echo returns)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError("prompt: empty", "prompt")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(_TextPrompt(self.tokenizer.encode(p, bos=self.tokenizer.add_bos)))
                out[-1].text = p
            elif (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in p)):
                bad = [t for t in p if not 0 <= t < self.model.config.vocab_size]
                if bad:
                    raise ApiError(f"prompt: token id {bad[0]} is outside the vocabulary of "
                                   f"{self.model.config.vocab_size}", "prompt")
                out.append(list(p))
            else:
                raise ApiError("prompt: expected a string, a list of strings, or token ids",
                               "prompt")
        for ids in out:
            if not ids:
                raise ApiError("prompt: a prompt encodes to no tokens", "prompt")
        return out

    def _chat_prompt(self, messages: list) -> list[int]:
        for i, m in enumerate(messages):
            if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)):
                raise ApiError(f"messages[{i}]: expected {{\"role\": str, \"content\": str}}",
                               "messages")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise ApiError(f"messages[{i}].role: {m['role']!r} is not system, user or "
                               f"assistant", "messages")
            extra = set(m) - {"role", "content", "name"}
            if extra:
                raise ApiError(f"messages[{i}]: {sorted(extra)[0]} is not supported by this "
                               f"server", "messages", code="unsupported_parameter")
        if not messages:
            raise ApiError("messages: empty", "messages")
        messages = [{"role": "system" if m["role"] == "developer" else m["role"],
                     "content": m["content"]} for m in messages]
        try:
            return self.template.encode(messages, self.tokenizer, add_generation_prompt=True)
        except BridgeError as e:
            raise ApiError(f"messages: {e}", "messages") from None

    def _room(self, ids: list[int], s: Sampling, echo_only: bool = False) -> int:
        """max_tokens for this prompt: the request's, or what the context leaves (chat)."""
        limit = self.engine.max_len
        if len(ids) >= limit and not echo_only:
            raise ApiError(f"prompt: {len(ids)} tokens leave no room for a new one in the "
                           f"context of {limit}", "messages" if s.max_tokens is None else "prompt",
                           code="context_length_exceeded")
        if echo_only:
            if len(ids) > self.model.config.max_seq_len:
                raise ApiError(f"prompt: {len(ids)} tokens, more than the context of "
                               f"{self.model.config.max_seq_len}", "prompt",
                               code="context_length_exceeded")
            return 0
        room = limit - len(ids)
        if s.max_tokens is None:
            return room
        if s.max_tokens > room:
            raise ApiError(f"max_tokens: {len(ids)} prompt tokens and {s.max_tokens} new ones "
                           f"exceed the context of {limit}", "max_tokens",
                           code="context_length_exceeded")
        return s.max_tokens

    # -- generation

    async def _generate(self, ids: list[int], max_tokens: int, s: Sampling, seed: int,
                        top_logprobs: int) -> AsyncIterator[tuple[str, Any]]:
        """Events of one choice: ("token", Token) ... then ("finish", reason)."""
        from jax_llama.serving import Request

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = Request(prompt=ids, max_tokens=max_tokens,
                          on_token=lambda t: loop.call_soon_threadsafe(events.put_nowait,
                                                                       ("token", t)),
                          on_finish=lambda r: loop.call_soon_threadsafe(events.put_nowait,
                                                                        ("finish", r)),
                          temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed,
                          stop_ids=self.stop_ids, top_logprobs=top_logprobs)
        self.engine.submit(request)
        try:
            while True:
                event = await events.get()
                yield event
                if event[0] == "finish":
                    return
        finally:  # the client went away, or a stop string ended the choice: free the row
            request.cancelled.set()

    async def _choice(self, ids, max_tokens, s: Sampling, seed: int, top_logprobs: int):
        """One choice's text pieces: yields (text, [(Token, its text)], None) as text becomes
        safe to show, then (rest, tokens, finish_reason)."""
        stream = TextStream(self.tokenizer, s.stops)
        pending: list = []
        async for kind, value in self._generate(ids, max_tokens, s, seed, top_logprobs):
            if kind == "finish":
                if value.startswith("error"):
                    raise ApiError(value, status=500, kind="server_error")
                reason = "length" if value == "length" else "stop"
                yield stream.finish(), pending, reason
                return
            if value.id in self.stop_ids:
                pending.append((value, None))
                continue
            text = stream.push(value.id)
            pending.append((value, self.tokenizer.decode([value.id])))
            if stream.stopped:
                yield text, pending, "stop"
                return
            if text:
                yield text, pending, None
                pending = []

    def _seed(self, s: Sampling, i: int) -> int:
        return (s.seed + i if s.seed is not None else secrets.randbits(31)) & 0x7FFFFFFF

    # -- /v1/completions

    async def completions(self, body: dict):
        body = check_fields(body, COMPLETION, ("model", "prompt"))
        self._check_model(body)
        if body.get("suffix"):
            raise ApiError("suffix: not supported by this server", "suffix",
                           code="unsupported_parameter")
        logprobs = body.get("logprobs")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise ApiError(f"logprobs: must be in [0, 20] (got {logprobs})", "logprobs")
        s = sampling(body, DEFAULT_MAX_TOKENS, logprobs)
        if body.get("best_of") not in (None, s.n):
            raise ApiError("best_of: not supported by this server (only equal to n)", "best_of",
                           code="unsupported_parameter")
        echo = bool(body.get("echo"))
        if s.max_tokens == 0 and not echo:
            raise ApiError("max_tokens: 0 only with echo", "max_tokens")
        if echo and s.stream:
            raise ApiError("echo: not with stream", "echo")
        prompts = self._completion_prompts(body["prompt"])
        budgets = [self._room(ids, s, echo_only=s.max_tokens == 0) for ids in prompts]
        rid = f"cmpl-{secrets.token_hex(12)}"
        if s.stream:
            return self._stream("text_completion", rid, prompts, budgets, s, chat=False)
        choices, used = [], 0
        tasks = [self._complete_one(ids, budget, s, self._seed(s, i), echo)
                 for ids, budget in zip(prompts, budgets) for i in range(s.n)]
        for index, (choice, n_tokens) in enumerate(await asyncio.gather(*tasks)):
            choices.append({"index": index, **choice})
            used += n_tokens
        prompt_tokens = sum(len(p) for p in prompts) * s.n
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": _usage(prompt_tokens, used)}

    async def _complete_one(self, ids, budget: int, s: Sampling, seed: int, echo: bool):
        text, tokens, reason = "", [], "length"
        if budget:
            async for piece, done, finish in self._choice(ids, budget, s, seed, s.logprobs or 0):
                text += piece
                tokens += done
                if finish:
                    reason = finish
        produced = len(tokens)
        logprobs = None
        if s.logprobs is not None:
            shown = _trim_to_text([(t, w) for t, w in tokens if w is not None], len(text))
            entries = [(w, t.logprob, t.top) for t, w in shown]
            prefix = ""
            if echo:
                scored = await asyncio.get_running_loop().run_in_executor(
                    None, self._prompt_logprobs, ids, max(s.logprobs, 1))
                prefix = _echo_text(self.tokenizer, ids)
                entries = [(self.tokenizer.decode([tid]),
                            None if tok is None else tok.logprob,
                            None if tok is None else tok.top[:s.logprobs])
                           for tid, tok in zip(ids, scored)] + entries
            logprobs = self._legacy_logprobs(entries)
            if echo:
                text = prefix + text
        elif echo:
            text = _echo_text(self.tokenizer, ids) + text
        return {"text": text, "logprobs": logprobs, "finish_reason": reason}, produced

    def _prompt_logprobs(self, ids, n_top):
        from jax_llama.serving import prompt_logprobs
        return prompt_logprobs(self.model, self.params, ids, n_top)

    def _legacy_logprobs(self, entries) -> dict:
        offsets, at = [], 0
        for word, _, _ in entries:
            offsets.append(at)
            at += len(word)
        return {"tokens": [w for w, _, _ in entries],
                "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else
                                 {self.tokenizer.decode([i]): v for i, v in top}
                                 for _, _, top in entries],
                "text_offset": offsets}

    # -- /v1/chat/completions

    async def chat(self, body: dict):
        body = check_fields(body, CHAT, ("model", "messages"))
        self._check_model(body)
        top = body.get("top_logprobs")
        if top is not None and not 0 <= top <= 20:
            raise ApiError(f"top_logprobs: must be in [0, 20] (got {top})", "top_logprobs")
        if top and not body.get("logprobs"):
            raise ApiError("top_logprobs: only with logprobs", "top_logprobs")
        s = sampling(body, None, (top or 0) if body.get("logprobs") else None)
        if s.max_tokens == 0:
            raise ApiError("max_tokens: must be >= 1", "max_tokens")
        ids = self._chat_prompt(body["messages"])
        budget = self._room(ids, s)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        if s.stream:
            return self._stream("chat.completion.chunk", rid, [ids], [budget], s, chat=True)
        results = await asyncio.gather(*[self._chat_one(ids, budget, s, self._seed(s, i))
                                         for i in range(s.n)])
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": i, **c} for i, (c, _) in enumerate(results)],
                "usage": _usage(len(ids) * s.n, sum(n for _, n in results))}

    async def _chat_one(self, ids, budget, s: Sampling, seed: int):
        text, tokens, reason = "", [], "length"
        async for piece, done, finish in self._choice(ids, budget, s, seed, s.logprobs or 0):
            text += piece
            tokens += done
            if finish:
                reason = finish
        logprobs = None
        if s.logprobs is not None:
            shown = _trim_to_text([(t, w) for t, w in tokens if w is not None], len(text))
            logprobs = {"content": [self._chat_logprob(t, w) for t, w in shown]}
        return ({"message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": reason}, len(tokens))

    def _chat_logprob(self, token, word: str) -> dict:
        top = [{"token": (w := self.tokenizer.decode([i])), "logprob": v,
                "bytes": list(w.encode())} for i, v in token.top]
        return {"token": word, "logprob": token.logprob, "bytes": list(word.encode()),
                "top_logprobs": top}

    # -- streams

    async def _stream(self, obj: str, rid: str, prompts, budgets, s: Sampling, chat: bool):
        """The SSE lines of a streamed request: every choice's chunks as they come, interleaved,
        each choice's last with its finish_reason; the usage chunk if asked; [DONE]."""
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        counts = {}

        def chunk(index: int, text: str | None, reason: str | None, tokens, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {} if text is None else {"content": text})
                choice = {"index": index, "delta": delta, "logprobs": None,
                          "finish_reason": reason}
                if s.logprobs is not None and tokens:
                    choice["logprobs"] = {"content": [self._chat_logprob(t, w)
                                                      for t, w in tokens]}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": reason,
                          "logprobs": self._legacy_logprobs([(w, t.logprob, t.top)
                                                             for t, w in tokens])
                          if s.logprobs is not None else None}
            return {"id": rid, "object": obj, "created": created, "model": self.name,
                    "choices": [choice]}

        async def run(index: int, ids, budget, seed):
            shown_len = 0
            try:
                if chat:
                    await queue.put(chunk(index, None, None, [], first=True))
                counts[index] = 0
                async for piece, done, finish in self._choice(ids, budget, s, seed,
                                                              s.logprobs or 0):
                    counts[index] += len(done)
                    shown_len += len(piece)
                    words = [(t, w) for t, w in done if w is not None]
                    if finish:
                        if piece or words:
                            await queue.put(chunk(index, piece, None, _trim_to_text(
                                words, len(piece)) if words else []))
                        await queue.put(chunk(index, None, finish, []))
                    elif piece:
                        await queue.put(chunk(index, piece, None, words))
            except ApiError as e:
                await queue.put(e)
            finally:
                await queue.put(None)

        jobs = [(ids, budget, self._seed(s, i)) for ids, budget in zip(prompts, budgets)
                for i in range(s.n)]
        tasks = [asyncio.create_task(run(i, *job)) for i, job in enumerate(jobs)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, ApiError):
                    yield _sse(item.body())
                    continue
                yield _sse(item)
            if s.include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.name,
                            "choices": [], "usage": _usage(
                                sum(len(p) for p in prompts) * s.n, sum(counts.values()))})
            yield "data: [DONE]\n\n"
        finally:  # the client went away: every choice's row is freed
            for t in tasks:
                t.cancel()

    # -- the rest

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "created": self.created, "owned_by": "jax-llama"}]}

    def tokenizer_info(self) -> dict:
        t = self.tokenizer
        name = lambda i: None if i is None else t.decode([i])
        return {"eos_token": name(t.eos_id), "bos_token": name(t.bos_id),
                "pad_token": name(t.pad_id), "model_max_length": self.engine.max_len,
                "chat_template": getattr(self.template, "source", None)}

    def tokenize(self, body: dict) -> dict:
        body = check_fields(body, {"prompt": str, "add_special_tokens": bool, "model": str},
                            ("prompt",))
        bos = bool(body.get("add_special_tokens", True)) and self.tokenizer.add_bos
        ids = self.tokenizer.encode(body["prompt"], bos=bos)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_len}

    def detokenize(self, body: dict) -> dict:
        body = check_fields(body, {"tokens": list, "model": str}, ("tokens",))
        try:
            return {"prompt": self.tokenizer.decode(body["tokens"])}
        except BridgeError as e:
            raise ApiError(f"tokens: {e}", "tokens") from None


class _TextPrompt(list):
    """A prompt's ids, with the text they were encoded from."""
    text: str


def _echo_text(tokenizer, ids) -> str:
    """What echo returns for a prompt: its text as given, or its ids decoded."""
    return ids.text if isinstance(ids, _TextPrompt) else tokenizer.decode(ids)


def _trim_to_text(tokens: list, length: int) -> list:
    """The (Token, text) pairs whose text starts within the first `length` characters."""
    out, at = [], 0
    for t, w in tokens:
        if at >= length:
            break
        out.append((t, w))
        at += len(w)
    return out


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# -- the HTTP app -------------------------------------------------------------------------------

def app(server: Server):
    """The Starlette app: JSON in, the server's answer or its error object out."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def authorized(request: Request) -> bool:
        if server.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given, f"Bearer {server.api_key}")

    def refuse(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def endpoint(handler, takes_body: bool = True):
        async def route(request: Request):
            if not authorized(request):
                return refuse(ApiError("a valid API key is required (Authorization: Bearer "
                                       "KEY)", status=401, kind="authentication_error",
                                       code="invalid_api_key"))
            try:
                if takes_body:
                    raw = await request.body()
                    try:
                        body = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise ApiError(f"the request body is not valid JSON ({e})") from None
                    result = handler(body)
                else:
                    result = handler()
                if asyncio.iscoroutine(result):
                    result = await result
            except ApiError as e:
                return refuse(e)
            except BridgeError as e:
                return refuse(ApiError(str(e), getattr(e, "field", None)))
            if hasattr(result, "__aiter__"):
                return StreamingResponse(result, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return JSONResponse(result)
        return route

    return Starlette(routes=[
        Route("/health", endpoint(lambda: {"status": "ok"}, False), methods=["GET"]),
        Route("/v1/models", endpoint(server.models, False), methods=["GET"]),
        Route("/v1/completions", endpoint(server.completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(server.chat), methods=["POST"]),
        Route("/tokenizer_info", endpoint(server.tokenizer_info, False), methods=["GET"]),
        Route("/tokenize", endpoint(server.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(server.detokenize), methods=["POST"]),
    ])


def serve_in_thread(server: Server, host: str = "127.0.0.1"):
    """Serve `server` on a free port of `host` from a thread (tests and the benchmark):
    (base URL, stop())."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(app(server), host=host, port=port, log_level="error"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)

    def stop():
        http.should_exit = True
        thread.join(10)
        server.engine.close()
    return f"http://{host}:{port}", stop
