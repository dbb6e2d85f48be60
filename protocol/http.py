"""HTTP error handling shared by every aiohttp server of the project (node, scheduler).

Invariants:
- Every refused request gets a 4xx/5xx with a JSON body `{"error": {"message", "type",
  "code"}}` and one log line; handlers signal refusals by raising (an aiohttp HTTP
  exception, an `EnvelopeError`, a `CodecError`, a pydantic `ValidationError`, or one of
  `extra` mapped to a status), never by crashing the server. An unexpected exception still
  answers a JSON 500 (`server_error`) and logs its traceback; a body that cannot be read
  (a Content-Encoding that does not decode, broken chunked framing) a JSON 400; a
  `TimeoutError` a JSON 408 when the request body was not read in full (a slow client), a
  JSON 504 otherwise. (Requests aiohttp's HTTP parser refuses before any middleware runs,
  such as bad header bytes, get aiohttp's own plain-text 400.)
- `read_json` hands a handler only a JSON object that round-trips: strict UTF-8 (or the
  UTF-16/32 that RFC 8259 detection allows), at most `MAX_JSON_DEPTH` levels of nesting, no
  NaN/Infinity, integers within 64 bits (`JSON_INT_MIN`..`JSON_INT_MAX`), and no string or
  key that cannot be encoded as UTF-8 (a lone surrogate from a `\\ud800` escape). Every
  other body (garbage, too deep for the parser, an integer over Python's digit limit) is a
  `CodecError`, i.e. a 400.
- `body_timeout_middleware(s)` reads every request body within `s` seconds before the
  handler runs (aiohttp caches it: later reads are instant); a client that is slower gets
  a JSON 408 and its connection is closed, so a partial body never holds a connection.
- `serve_app` is how a process serves its app until SIGINT/SIGTERM, the same way for
  every server: on `HttpServerConfig`'s host and port, no banner, no access log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from protocol.codec import CodecError
from protocol.config import HttpServerConfig
from protocol.envelope import EnvelopeError

MSGPACK = "application/msgpack"
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects `read_json` accepts (an OpenAI body needs ~6)."""
JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**64 - 1
"""Integers outside [JSON_INT_MIN, JSON_INT_MAX] are refused (msgpack, numpy and torch
cannot hold them; no field of the protocol needs them)."""


def serve_app(
    app: web.Application,
    cfg: HttpServerConfig,
    loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """Serve `app` on `cfg.host`:`cfg.port` until SIGINT/SIGTERM (then its cleanup hooks
    run). No banner and no access log: each process prints its own start line."""
    web.run_app(
        app,
        host=cfg.host,
        port=cfg.port,
        print=None,
        access_log=None,
        handle_signals=True,
        loop=loop,
    )


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )


def _body_unread(request: web.BaseRequest) -> bool:
    """True while the request has a body that was not read in full (and cached) yet."""
    return request.body_exists and getattr(request, "_read_bytes", None) is None


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
        except (RequestPayloadError, HttpProcessingError) as exc:
            # The body could not be read: a bad Content-Encoding or chunked framing.
            status = getattr(exc, "code", 400)
            status = status if 400 <= status < 500 else 400
            msg = f"malformed request body: {_one_line(exc)}"
            log.warning("%s %s -> %d %s", request.method, request.path, status, msg)
            resp = error_response(status, msg)
            resp.force_close()  # what is left of the body cannot be parsed either
            return resp
        except TimeoutError as exc:  # asyncio.TimeoutError is TimeoutError (3.11+)
            if _body_unread(request):
                log.warning(
                    "%s %s -> 408 request body not received in time", request.method, request.path
                )
                resp = error_response(408, "request body not received in time", "timeout")
                resp.force_close()
                return resp
            log.warning("%s %s -> 504 timed out: %s", request.method, request.path, exc)
            return error_response(504, f"timed out: {exc or 'no answer in time'}", "timeout")
        except ConnectionResetError:
            # The client hung up mid-request: no one reads an answer, and a traceback per
            # hang-up would let anyone flood the log for free. One short line.
            log.info("%s %s: the client hung up mid-request", request.method, request.path)
            resp = error_response(400, "the connection was lost mid-request")
            resp.force_close()  # nobody is there to read it
            return resp
        except Exception as exc:
            for cls, status in mapped:
                if isinstance(exc, cls):
                    log.warning("%s %s -> %d %s", request.method, request.path, status, exc)
                    return error_response(status, str(exc))
            log.exception(
                "%s %s -> 500 unhandled %s", request.method, request.path, type(exc).__name__
            )
            return error_response(500, f"internal error ({type(exc).__name__})", "server_error")

    return middleware


def _one_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = getattr(cause, "message", None) or str(cause)
    return " ".join(str(text).split()) or type(exc).__name__


def body_timeout_middleware(seconds: float, log: logging.Logger | None = None):
    """A middleware reading each request body within `seconds` (JSON 408 and a closed
    connection otherwise). Put it after `error_middleware` (a body over `client_max_size`
    raises 413 here) and after cheap refusals such as rate limits."""
    logger = log or logging.getLogger("prime.http")

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.body_exists:
            try:
                # asyncio.timeout, not wait_for: no extra task, whose exception would hold
                # the partly read body in a reference cycle (memory until a GC pass).
                async with asyncio.timeout(seconds):
                    await request.read()
            except TimeoutError:
                logger.warning(
                    "%s %s -> 408 request body not received within %g s",
                    request.method,
                    request.path,
                    seconds,
                )
                resp = error_response(
                    408, f"request body not received within {seconds:g} s", "timeout"
                )
                resp.force_close()
                return resp
        return await handler(request)

    return middleware


def _reject_constant(name: str) -> float:
    raise CodecError(f"malformed JSON: {name} is not a JSON number")


def _check_tree(body: object) -> None:
    """Refuse what json.loads accepts but a handler must never see (iteratively: no depth
    limit of our own stack)."""
    stack: list[tuple[list | dict, int]] = []
    if isinstance(body, list | dict):
        stack.append((body, 1))
    else:
        _check_scalar(body)
    while stack:
        container, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise CodecError(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(container, dict):
            for key in container:
                _check_str(key)
            items = container.values()
        elif _numbers_in_range(container):
            continue
        else:
            items = container
        for item in items:
            if isinstance(item, list | dict):
                stack.append((item, depth + 1))
            else:
                _check_scalar(item)


def _numbers_in_range(items: list) -> bool:
    """A fast path for long lists of token ids: True if every item is a number within
    [JSON_INT_MIN, JSON_INT_MAX] (min/max run in C and raise TypeError on anything but
    numbers; an infinite float fails the bounds; JSON has no NaN). False means: check
    item by item."""
    if not items or type(items[0]) is not int:
        return False
    try:
        return min(items) >= JSON_INT_MIN and max(items) <= JSON_INT_MAX
    except TypeError:
        return False


def _check_scalar(value: object) -> None:
    if isinstance(value, str):
        _check_str(value)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not JSON_INT_MIN <= value <= JSON_INT_MAX:
            raise CodecError(
                f"integer out of range ({value.bit_length()} bits): JSON integers must be "
                f"within [{JSON_INT_MIN}, {JSON_INT_MAX}]"
            )
    elif isinstance(value, float) and not math.isfinite(value):
        raise CodecError("number out of range: JSON numbers must be finite")


def _check_str(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CodecError(
            f"malformed JSON: string with a lone surrogate at {exc.start} (not encodable as UTF-8)"
        ) from exc


def parse_json(raw: bytes) -> object:
    """`raw` as JSON under `read_json`'s rules (any top-level value), or a CodecError."""
    try:
        text = raw.decode(json.detect_encoding(raw))  # strict: no 'surrogatepass'
    except (UnicodeDecodeError, LookupError) as exc:
        raise CodecError(f"malformed JSON: body is not valid UTF-8 ({exc})") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise CodecError(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # JSONDecodeError, and Python's limit on int digits
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"malformed JSON: {exc}") from exc
    _check_tree(body)
    return body


async def read_json(request: web.Request, model: type[BaseModel] | None = None):
    """The request's JSON object body (validated into `model` when given), or a CodecError."""
    body = parse_json(await request.read())
    if not isinstance(body, dict):
        raise CodecError("request body must be a JSON object")
    return body if model is None else model.model_validate(body)
