"""The endpoints' logic (Server): a checked request becomes prompts for the batching engine
(jax_llama.inference.serving.Engine), its tokens become OpenAI's answers, whole or streamed as
Server-Sent Events; stop strings are cut on the text (tasks.prompts.TextStream)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from bridge.errors import BridgeError
from tasks.prompts import TextStream

from .requests import (CHAT, COMPLETION, DEFAULT_MAX_TOKENS, ApiError, Sampling, check_fields,
                       sampling)


class Server:
    """The endpoints' logic over an engine (jax_llama.inference.serving.Engine), a tokenizer and a
    chat template; the HTTP app (app()) only moves JSON in and out."""

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
        from jax_llama.inference.serving import Request

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
        from jax_llama.inference.serving import prompt_logprobs
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
