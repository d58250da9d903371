"""The HTTP app over a Server: Starlette routes that move JSON in and out (and check the API key),
and a thread to serve it from in tests and the benchmark."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from bridge.errors import BridgeError

from .endpoints import Server
from .requests import ApiError


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
