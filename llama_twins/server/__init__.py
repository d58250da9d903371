"""`jax-llama serve`: an OpenAI-compatible HTTP server over jax_llama.inference.serving's
batching engine.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the
model's own chat template), and vLLM's /tokenizer_info, /tokenize and /detokenize, through which
lm-evaluation-harness' `local-completions` tokenizes as the server does.

Every request's fields are checked by name and type before anything runs: a field this server
does not implement is refused (400), never ignored. Stop strings are cut on the text
(tasks.prompts.TextStream): never returned, never partly streamed. Streams are Server-Sent
Events, `data: {...}` chunks, the last of each choice with its finish_reason, then `data: [DONE]`.
A client that goes away mid-stream cancels its rows, which the next request then takes.

The app is Starlette's (FastAPI's base); uvicorn runs it. Both are in the [serve] extra.

Laid out as a request travels: requests.py checks a request's fields and reads its sampling
settings, endpoints.py (Server) turns it into prompts for the engine and its results into
OpenAI's answers, app.py carries JSON between HTTP and the Server.
"""

from .app import app, serve_in_thread
from .endpoints import Server
from .requests import (CHAT, COMMON, COMPLETION, DEFAULT_MAX_TOKENS, MAX_N, ApiError, Sampling,
                       check_fields, sampling)

__all__ = ["ApiError", "CHAT", "COMMON", "COMPLETION", "DEFAULT_MAX_TOKENS", "MAX_N", "Sampling",
           "Server", "app", "check_fields", "sampling", "serve_in_thread"]
