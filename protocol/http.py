"""HTTP error handling shared by every aiohttp server of the project (node, scheduler).

Invariants: every refused request gets a 4xx/5xx with a JSON body
`{"error": {"message", "type", "code"}}` and one log line; handlers signal refusals by
raising (an aiohttp HTTP exception, an `EnvelopeError`, a `CodecError`, a pydantic
`ValidationError`, or one of `extra` mapped to a status), never by crashing the server.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from pydantic import BaseModel, ValidationError

from protocol.codec import CodecError
from protocol.envelope import EnvelopeError

MSGPACK = "application/msgpack"


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )


def error_middleware(log: logging.Logger, extra: dict[type[Exception], int] | None = None):
    """A middleware turning refusals into JSON errors; `extra` maps more exception types."""
    mapped = tuple((extra or {}).items())

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            status, msg, kind = exc.status, exc.text or exc.reason, "invalid_request_error"
            headers = {k: v for k, v in exc.headers.items() if k == "Retry-After"}
            log.warning("%s %s -> %d %s", request.method, request.path, status, msg)
            resp = error_response(status, msg, kind)
            resp.headers.update(headers)
            return resp
        except EnvelopeError as exc:
            log.warning("%s %s -> %d %s", request.method, request.path, exc.status, exc)
            return error_response(exc.status, str(exc), "authentication_error")
        except CodecError as exc:
            log.warning("%s %s -> 400 %s", request.method, request.path, exc)
            return error_response(400, str(exc))
        except ValidationError as exc:
            msg = validation_message(exc)
            log.warning("%s %s -> 400 %s", request.method, request.path, msg)
            return error_response(400, msg)
        except Exception as exc:
            for cls, status in mapped:
                if isinstance(exc, cls):
                    log.warning("%s %s -> %d %s", request.method, request.path, status, exc)
                    return error_response(status, str(exc))
            raise

    return middleware


async def read_json(request: web.Request, model: type[BaseModel] | None = None):
    """The request's JSON object body (validated into `model` when given), or a CodecError."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CodecError(f"malformed JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CodecError("request body must be a JSON object")
    return body if model is None else model.model_validate(body)
