"""OpenAI-compatible HTTP API over the engine: Starlette app, served by uvicorn (`trellis serve`).

Why Starlette + uvicorn: both are small, widely used and actively maintained ASGI pieces;
Starlette gives routing, streaming responses (SSE) and request access without a validation
framework we would not use, and uvicorn is the reference ASGI server.

Requests never touch the model directly: a request builds a protocol `Generate`, its prompt is
tokenized up front (so a bad request gets its 4xx before any streaming starts), and the
generation runs as a job on the shared EngineQueue, in arrival order with every other request.
Token deltas cross from the engine thread to the event loop through an asyncio queue. A client
that disconnects mid-stream cancels its job.

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions
(both with "stream": true for server-sent events), POST /v1/tokenize (token counting), GET /health.
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.worker import protocol as p
from engine.worker.host import ModelHost, WorkerError
from engine.worker.jobs import EngineQueue, Job

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # room for a few data-URL images
DRAIN_LIMIT_BYTES = 8 * 1024 * 1024  # how much of an oversized upload is read before the 413
DEFAULT_MAX_TOKENS = 512


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# Worker error codes -> HTTP status
_STATUS = {p.ErrorCode.BAD_COMMAND: 400, p.ErrorCode.UNSUPPORTED: 400, p.ErrorCode.NO_MODEL: 503,
           p.ErrorCode.OUT_OF_MEMORY: 507, p.ErrorCode.NOT_FOUND: 404}


def _from_worker_error(e: WorkerError) -> ApiError:
    status = _STATUS.get(e.code, 500)
    return ApiError(status, str(e), e.code, kind="invalid_request_error" if status < 500 else "server_error")


@dataclass
class ServerSettings:
    model_id: str
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS


class EngineApi:
    """The request handlers, bound to one host (with its loaded model) and one queue."""

    def __init__(self, host: ModelHost, engine: EngineQueue, settings: ServerSettings):
        self.host, self.engine, self.settings = host, engine, settings
        self.created = int(time.time())

    # ------------------------------------------------------------------ request plumbing

    def _check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {key}":
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)", "invalid_api_key",
                           kind="authentication_error")

    async def _json_body(self, request: Request) -> dict:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", "request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > limit + DRAIN_LIMIT_BYTES:
                    break
                # Over the limit: read (and drop) a bounded rest of the upload before answering, since
                # closing a socket with unread data resets it and the client would see a reset, not a 413.
            if size > limit:
                raise ApiError(413, f"request body is over the {limit}-byte limit", "request_too_large")
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected while sending the request", "client_disconnected")
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON ({e})", "invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_json")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise ApiError(400, "'model' is required", "missing_model", "model")
        if model not in (self.settings.model_id, self.host.info.model_dir if self.host.info else None):
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.settings.model_id}'", "model_not_found", "model")

    def _model_card(self) -> dict:
        info = self.host.info
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "trellis",
                "max_model_len": info.max_context if info else None}

    # ------------------------------------------------------------------ building requests

    def _sampler(self, body: dict) -> p.SamplerParams:
        s = p.SamplerParams(temperature=1.0, top_k=0, top_p=1.0)
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                           ("repetition_penalty", float), ("seed", int)):
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise ApiError(400, f"'{name}' must be a number", "invalid_value", name)
            setattr(s, name, kind(value))
        return s

    def _common(self, body: dict, rid: str) -> p.Generate:
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", "unsupported_value", "n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, "'max_tokens' must be a positive integer", "invalid_value", "max_tokens")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ApiError(400, "'stop' must be a string or a list of strings", "invalid_value", "stop")
        return p.Generate(id=rid, request_id=rid, sampler=self._sampler(body), max_tokens=max_tokens, stop=stop)

    def _chat_request(self, body: dict, rid: str) -> p.Generate:
        req = self._common(body, rid)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "invalid_value", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] needs a 'role'", "invalid_value", "messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict):
                        raise ApiError(400, f"messages[{i}].content parts must be objects", "invalid_value", "messages")
                    if part.get("type") in ("image_url", "input_image", "image"):
                        req.images.append(self._image_source(part, i))
                        parts.append({"type": "image"})
                    elif part.get("type") == "text":
                        parts.append({"type": "text", "text": str(part.get("text", ""))})
                    else:
                        raise ApiError(400, f"messages[{i}]: unsupported content part type {part.get('type')!r}",
                                       "invalid_value", "messages")
                content = parts
            elif content is not None and not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", "invalid_value",
                               "messages")
            clean.append({"role": m["role"], "content": content if content is not None else ""})
        if req.images and not (self.host.info and self.host.info.vision):
            raise ApiError(400, f"the model '{self.settings.model_id}' does not accept images (it has no vision "
                                "tower); send text only", "model_not_vision", "messages")
        req.messages = clean
        return req

    def _image_source(self, part: dict, index: int) -> str:
        """An image part as a data URL or an existing local file path (validated, not decoded)."""
        ref = part.get("image_url", part.get("image"))
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"messages[{index}]: image part without a url", "invalid_value", "messages")
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if not header.startswith("data:image/") or ";base64" not in header:
                raise ApiError(400, f"messages[{index}]: image data URLs must be data:image/...;base64,...",
                               "invalid_image", "messages")
            try:
                base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"messages[{index}]: the image data URL is not valid base64", "invalid_image",
                               "messages")
            return url
        path = Path(url[len("file://"):] if url.startswith("file://") else url).expanduser()
        if url.startswith(("http://", "https://")):
            raise ApiError(400, f"messages[{index}]: remote image URLs are not fetched; send a data URL or a "
                                "local file path", "invalid_image", "messages")
        if not path.is_file():
            raise ApiError(400, f"messages[{index}]: image file not found: {path}", "invalid_image", "messages")
        return str(path)

    def _completion_request(self, body: dict, rid: str) -> p.Generate:
        req = self._common(body, rid)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per request)", "invalid_value", "prompt")
        req.prompt = prompt
        return req

    async def _prompt_ids(self, req: p.Generate) -> list[int]:
        try:
            ids = await run_in_threadpool(self.host.prompt_ids, req)
        except WorkerError as e:
            raise _from_worker_error(e) from None
        limit = self.host.info.max_context if self.host.info else 0
        if limit and len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {limit}",
                           "context_length_exceeded", "messages" if req.messages is not None else "prompt")
        return ids

    # ------------------------------------------------------------------ running

    def _start(self, req: p.Generate, ids: list[int]) -> asyncio.Queue:
        """Queue the generation; events ("text", str) ... then ("done", outcome) or ("error", ApiError)
        arrive on the returned asyncio queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        def run(should_stop) -> None:
            try:
                outcome = self.host.generate(req, lambda text: put(("text", text)), should_stop, prompt_ids=ids)
                put(("done", outcome))
            except WorkerError as e:
                put(("error", _from_worker_error(e)))
            except Exception as e:  # keep the queue alive; tell this one client
                put(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal",
                                       kind="server_error")))

        self.engine.submit(Job(run=run, request_id=req.rid,
                               on_dropped=lambda: put(("error", ApiError(503, "the server is shutting down",
                                                                         "shutting_down", kind="server_error")))))
        return events

    async def _collect(self, req: p.Generate, ids: list[int]):
        events = self._start(req, ids)
        try:
            while True:
                kind, value = await events.get()
                if kind == "done":
                    return value
                if kind == "error":
                    raise value
        except asyncio.CancelledError:
            self.engine.cancel(req.rid)
            raise

    async def _sse(self, req: p.Generate, ids: list[int], chunk_fn, final_fn, include_usage: bool):
        events = self._start(req, ids)
        finished = False
        try:
            first = chunk_fn(None)
            if first is not None:
                yield _sse_line(first)
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield _sse_line(chunk_fn(value))
                elif kind == "done":
                    finished = True
                    yield _sse_line(final_fn(value, False))
                    if include_usage:
                        yield _sse_line(final_fn(value, True))
                    break
                else:
                    finished = True
                    yield _sse_line({"error": {"message": value.message, "type": value.kind, "code": value.code,
                                               "param": None}})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # client went away: stop its generation
                self.engine.cancel(req.rid)

    # ------------------------------------------------------------------ endpoints

    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_auth(request)
        if request.path_params["model_id"] != self.settings.model_id:
            raise ApiError(404, f"the model '{request.path_params['model_id']}' does not exist", "model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        running, queued = self.engine.snapshot()
        return JSONResponse({"status": "ok", "model": self.settings.model_id, "running": running is not None,
                             "queued": len(queued)})

    async def tokenize(self, request: Request) -> Response:
        self._check_auth(request)
        body = await self._json_body(request)
        self._check_model(body)
        rid = _new_id("tok")
        req = self._chat_request(body, rid) if "messages" in body else self._completion_request(
            {**body, "max_tokens": 1}, rid)
        try:
            ids = await run_in_threadpool(self.host.prompt_ids, req)
        except WorkerError as e:
            raise _from_worker_error(e) from None
        info = self.host.info
        return JSONResponse({"model": self.settings.model_id, "count": len(ids), "tokens": ids,
                             "max_model_len": info.max_context if info else None})

    async def chat_completions(self, request: Request) -> Response:
        self._check_auth(request)
        body = await self._json_body(request)
        self._check_model(body)
        rid = _new_id("chatcmpl")
        req = self._chat_request(body, rid)
        ids = await self._prompt_ids(req)
        created = int(time.time())
        model = self.settings.model_id

        if body.get("stream"):
            def chunk(text):
                delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

            def final(outcome, usage_only):
                if usage_only:
                    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(outcome)}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(outcome)}]}
            return _event_stream(self._sse(req, ids, chunk, final, _include_usage(body)))

        outcome = await self._collect(req, ids)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                         "finish_reason": _finish(outcome), "logprobs": None}],
            "usage": _usage(outcome)})

    async def completions(self, request: Request) -> Response:
        self._check_auth(request)
        body = await self._json_body(request)
        self._check_model(body)
        rid = _new_id("cmpl")
        req = self._completion_request(body, rid)
        ids = await self._prompt_ids(req)
        created = int(time.time())
        model = self.settings.model_id

        if body.get("stream"):
            def chunk(text):
                if text is None:
                    return None
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}

            def final(outcome, usage_only):
                if usage_only:
                    return {"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(outcome)}
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": "", "finish_reason": _finish(outcome), "logprobs": None}]}
            return _event_stream(self._sse(req, ids, chunk, final, _include_usage(body)))

        outcome = await self._collect(req, ids)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": outcome.text, "finish_reason": _finish(outcome), "logprobs": None}],
            "usage": _usage(outcome)})


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event_stream(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _finish(outcome) -> str:
    return "length" if outcome.finish_reason == p.FinishReason.LENGTH else "stop"


def _usage(outcome) -> dict:
    s = outcome.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens}


def create_app(host: ModelHost, engine: EngineQueue, settings: ServerSettings) -> Starlette:
    api = EngineApi(host, engine, settings)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        return ApiError(status, f"{request.method} {request.url.path}: not found" if status == 404 else
                        str(getattr(exc, "detail", "error")), "not_found" if status == 404 else "http_error").response()

    routes = [Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/tokenize", api.tokenize, methods=["POST"]),
              Route("/health", api.health, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, 404: not_found, 405: not_found})
    app.state.api = api
    return app
