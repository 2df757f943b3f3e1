"""``dflash2 serve``: an OpenAI-compatible HTTP server on one loaded :class:`~dflash2.Model`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events or whole), ``GET /v1/models``, ``GET /health``. Every request is one ``model.stream``;
concurrent requests are concurrent streams, so they share the target's forwards (continuous
batching). A client that disconnects cancels its stream within one step: mid-stream Starlette
cancels the response's task; while a whole answer is generated a watcher cancels it; either way
leaving ``async with model.stream(...)`` closes the stream.
Bad requests get OpenAI-shaped 4xx errors; an unexpected failure a 500 without its traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash2.api import Model
from dflash2.errors import ContextLengthError, DFlash2Error
from dflash2.serve.protocol import (
    APIError,
    Job,
    Limits,
    chunk,
    parse_chat,
    parse_completion,
    response,
    usage_chunk,
)

log = logging.getLogger("dflash2.serve")


class Server:
    """The app's state: the model, its public name, the limits and the streams running now."""

    def __init__(self, model: Model, name: str, limits: Limits) -> None:
        self.model, self.name, self.limits = model, name, limits
        self.active = 0  # streams started and not yet closed

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        app = Starlette(routes=routes)
        app.state.server = self
        return app

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.name, "active_streams": self.active})

    async def models(self, request: Request) -> Response:
        entry = {"id": self.name, "object": "model", "created": 0, "owned_by": "dflash2"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def _answer(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request)
            job = (parse_chat if chat else parse_completion)(body, self.name, self.limits)
            if job.stream:
                events = self._events(job)
                await anext_ready(events)  # starts the stream: a bad prompt is still a 4xx here
                return StreamingResponse(events, media_type="text/event-stream")
            return JSONResponse(await self._whole(job, request))
        except APIError as err:
            return JSONResponse(err.body(), status_code=err.status)

    async def _body(self, request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.limits.max_body_bytes:
            raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes.")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > self.limits.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes.")
        try:
            return json.loads(raw)
        except ValueError as err:
            raise APIError(400, f"the request body is not valid JSON: {err}") from None
        except RecursionError:
            raise APIError(400, "the request body nests JSON too deeply to be a request.") from None

    def _open(self, job: Job) -> Any:
        try:
            return self.model.stream(job.prompt, **job.options)
        except ContextLengthError as err:
            raise APIError(400, str(err), "messages" if job.chat else "prompt", "context_length_exceeded") from None
        except DFlash2Error as err:
            raise APIError(400, str(err)) from None

    async def _whole(self, job: Job, request: Request) -> dict[str, Any]:
        """Generate to the end, unless the client goes away first: then the stream is cancelled."""
        stream = self._open(job)
        self.active += 1
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_disconnect, request, group.cancel_scope)
                async with stream:
                    async for _ in stream:
                        pass
                group.cancel_scope.cancel()  # done: stop watching
        except DFlash2Error as err:
            log.warning("generation failed: %s", err)
            raise APIError(500, "generation failed; see the server log.") from None
        finally:
            self.active -= 1
        done = stream.completion
        return response(job, done.text, done.finish_reason, done.stats)

    def _events(self, job: Job) -> AsyncIterator[str]:
        stream = self._open(job)
        self.active += 1
        return self._stream_events(job, stream)

    async def _stream_events(self, job: Job, stream: Any) -> AsyncIterator[str]:
        try:
            yield ""  # primed by anext_ready: the stream exists, nothing is sent yet
            async with stream:
                if job.chat:  # the role comes first, as OpenAI sends it
                    yield _sse(chunk(job, None, first=True))
                async for token in stream:
                    if token.text:
                        yield _sse(chunk(job, token.text))
            done = stream.completion
            yield _sse(chunk(job, None, done.finish_reason))
            if job.include_usage:
                yield _sse(usage_chunk(job, done.stats))
            yield "data: [DONE]\n\n"
        except DFlash2Error as err:
            log.warning("generation failed: %s", err)
            failure = APIError(500, "generation failed; see the server log.")
            yield _sse(failure.body())
        finally:
            self.active -= 1


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects (the body has been read: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def anext_ready(events: AsyncIterator[str]) -> None:
    """Advance a fresh event generator to its first (empty) event."""
    await events.__anext__()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(model: Model, name: str | None = None, limits: Limits | None = None) -> Starlette:
    """The ASGI app serving ``model`` under ``name`` (default: the checkpoint's directory name)."""
    served = name or model.checkpoint.name
    return Server(model, served, limits or Limits()).app()
