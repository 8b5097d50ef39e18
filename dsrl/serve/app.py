"""HTTP routes of the Tinker SDK 0.38 wire (tinker-protocol §2.7), all under ``/api/v1``.

Every request must carry a configured key in ``X-API-Key`` (else 401). JSON bodies everywhere
except forward/forward_backward (protobuf in) and the results of those and of sampling
(protobuf out, from retrieve_future). A request the server cannot read at all gets 400 with
``{"error", "category": "user"}``; a readable training request with bad contents gets a failed
future instead, so that it still consumes its seq_id (tinker-protocol §2.6).

The event loop only moves bytes and touches the service's books: decompressing, JSON and
protobuf decoding run on worker threads (`run_in_threadpool`), so one client's 100 MB
forward_backward does not hold another client's heartbeat or future poll behind it
(tests/serve/test_serve_limits.py states and checks the bound). The service's state is
still changed on the loop alone, one request at a time, as before."""
from __future__ import annotations

import hmac
import json
import logging
from typing import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from dsrl.serve.errors import UserError
from dsrl.serve.futures import ProtoReply
from dsrl.serve.requests import check_fields
from dsrl.serve.service import Service

log = logging.getLogger("dsrl.serve")
PROTO = "application/x-protobuf"


def _user_error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg, "category": "user"}, status_code=status)


def _parse_json(raw: bytes, path: str) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise UserError(f"{path}: body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise UserError(f"{path}: body must be a JSON object")
    return body


def _too_large(request: Request, size: int, limit: int) -> JSONResponse:
    return _user_error(f"{request.url.path}: request body of {size} bytes is over serve.max_request_bytes={limit}",
                       status=413)


async def _body(request: Request, limit: int, key: str) -> bytes:
    """The body, refused (UserError naming ``key``) past ``limit`` bytes, also when no
    content-length was sent (counted as it streams in)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise UserError(f"{request.url.path}: request body is over {key}={limit}")
        parts.append(part)
    return b"".join(parts)


async def _json(request: Request) -> dict:
    """The JSON object of the body, parsed on a worker thread. JSON bodies have a cap of their
    own (serve.max_json_bytes): the JSON parser holds the GIL, and with it the event loop, for as
    long as it parses."""
    raw = await _body(request, request.app.state.service.opts.max_json_bytes, "serve.max_json_bytes")
    return await run_in_threadpool(_parse_json, raw, request.url.path)


def build_app(service: Service, api_keys: Iterable[str]) -> FastAPI:
    keys = [k.encode() for k in api_keys]
    app = FastAPI(title="dsrl Tinker service", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        given = request.headers.get("x-api-key", "").encode()
        if not any(hmac.compare_digest(given, k) for k in keys):
            return JSONResponse({"error": "missing or invalid API key (X-API-Key)", "category": "user"},
                                status_code=401)
        request.state.api_key = given.decode()  # owns the checkpoints its sessions write
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > service.opts.max_request_bytes:
            return _too_large(request, int(declared), service.opts.max_request_bytes)
        return await call_next(request)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        return _user_error(str(exc))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect):
        """The client went away while its body streamed in: nobody to answer, nothing ran."""
        log.info("serve: %s: the client disconnected before its request arrived whole", request.url.path)
        return Response(status_code=400)

    @app.exception_handler(KeyError)
    async def not_found(request: Request, exc: KeyError):
        return _user_error(f"{request.url.path}: not found: {exc}", status=404)

    s = service
    v1 = "/api/v1"

    @app.post(f"{v1}/client/config")
    async def client_config(request: Request):
        return s.client_config()

    @app.post(f"{v1}/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get(f"{v1}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities():
        return s.capabilities()

    @app.post(f"{v1}/create_session")
    async def create_session(request: Request):
        return s.create_session(await _json(request), request.state.api_key)

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request):
        body = await _json(request)
        check_fields("session_heartbeat", body)
        if not s.heartbeat(body.get("session_id")):
            return JSONResponse({"error": "session finished or unknown", "category": "user"}, status_code=410)
        return {"type": "session_heartbeat"}

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(session_id: str):
        s.finish_session(session_id)
        return {"status": "ok"}

    @app.post(f"{v1}/telemetry")
    async def telemetry(request: Request):
        return {"status": "accepted"}

    @app.post(f"{v1}/create_model")
    async def create_model(request: Request):
        return s.create_model(await _json(request))

    @app.post(f"{v1}/get_info")
    async def get_info(request: Request):
        return s.get_info(await _json(request))

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request):
        raw = await _body(request, s.opts.max_request_bytes, "serve.max_request_bytes")
        call = await run_in_threadpool(s.decode_forward_backward, raw, request.headers.get("content-encoding", ""))
        return s.forward_backward(call)

    @app.post(f"{v1}/optim_step")
    async def optim_step(request: Request):
        return s.optim_step(await _json(request))

    @app.post(f"{v1}/save_weights")
    async def save_weights(request: Request):
        return s.save_weights(await _json(request))

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        return s.save_weights_for_sampler(await _json(request))

    @app.post(f"{v1}/load_weights")
    async def load_weights(request: Request):
        return s.load_weights(await _json(request), request.state.api_key)

    @app.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(request: Request):
        return s.create_sampling_session(await _json(request), request.state.api_key)

    @app.post(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request):
        s.set_published(run_id, f"{kind}/{name}", True, request.state.api_key)
        return {"status": "ok"}

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request):
        s.set_published(run_id, f"{kind}/{name}", False, request.state.api_key)
        return {"status": "ok"}

    @app.get(f"{v1}/training_runs/{{run_id}}")
    async def training_run(run_id: str, request: Request):
        return s.get_training_run(run_id, request.state.api_key)

    @app.get(f"{v1}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        return s.list_checkpoints(run_id, request.state.api_key)

    @app.get(f"{v1}/checkpoints")
    async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0):
        return s.list_user_checkpoints(request.state.api_key, limit, offset)

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
        s.delete_checkpoint(run_id, f"{kind}/{name}", request.state.api_key)
        return Response(status_code=204)

    @app.put(f"{v1}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request):
        s.set_checkpoint_ttl(run_id, f"{kind}/{name}", await _json(request), request.state.api_key)
        return Response(status_code=204)

    @app.get(f"{v1}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str):
        return s.get_sampler(sampler_id)

    @app.post(f"{v1}/asample")
    async def asample(request: Request):
        return s.asample(await _json(request))

    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request):
        body = await _json(request)
        check_fields("retrieve_future", body)
        rid = body.get("request_id")
        try:
            reply = await s.futures.wait(rid, s.opts.long_poll_seconds)
        except KeyError:
            why = (f"request_id {rid!r} finished and its result was dropped unread: finished results "
                   f"held more than serve.max_future_bytes={s.opts.max_future_bytes}") if s.futures.expired(rid) \
                else f"unknown request_id {rid!r}"
            return JSONResponse({"error": why, "category": "user"}, status_code=410)
        if reply is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if isinstance(reply, ProtoReply):
            return Response(content=reply.body, media_type=PROTO)
        return reply.body

    @app.api_route(f"{v1}/{{rest:path}}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unsupported(rest: str, request: Request):
        """Endpoints of the SDK this server does not serve (docs/guides/tinker.md lists them): 404 naming it."""
        return _user_error(f"{request.method} {v1}/{rest}: this endpoint is not served by dsrl's Tinker service "
                           "(docs/guides/tinker.md: what is not supported)", status=404)

    return app
