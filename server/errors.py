"""The OpenAI error envelope and every exception → status mapping (openai-api.md §6).

    {"error": {"message": ..., "type": "BadRequestError", "param": "top_p", "code": 400}}

`code` is the integer HTTP status (vLLM). Validation failures are 400, never FastAPI's 422; the
404/405 bodies of unknown routes use the envelope too.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from specserve.scheduler.messages import EngineDeadError, EngineOverloadedError
from specserve.server.engine_client import RequestTimeout
from specserve.server.generation import EngineRequestError
from specserve.spec_phases.sampling_params import ParamError

logger = logging.getLogger("specserve.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class APIError(Exception):
    """An error that becomes one OpenAI envelope. Raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def envelope(self) -> dict:
        return error_envelope(self.status, self.message, self.param)


def error_envelope(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_envelope(status, message, param), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def overloaded(retry_after_s: int) -> APIError:
    return APIError(503, "The server is overloaded: the waiting queue is full. Retry later.", None,
                    {"Retry-After": str(retry_after_s)})


def engine_dead() -> APIError:
    return APIError(503, "The engine is not running.", None, {"Retry-After": "30"})


def map_engine_exception(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """What an exception raised by `submit` (or while waiting on it) means for the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ParamError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, EngineOverloadedError):
        return overloaded(max(retry_after_s, exc.retry_after_s))
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc))
    logger.exception("engine failure", exc_info=exc)
    return APIError(500, f"The engine failed on this request: {type(exc).__name__}: {exc}")


def format_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """vLLM-style text ("1 validation error: ...") and the first field path without `body.`."""
    errors = exc.errors()
    param: str | None = None
    lines = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        if err.get("type") == "json_invalid":
            lines.append(f"JSON decode error: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        path = ".".join(loc)
        if param is None and path:
            param = path
        shown = json.dumps(err.get("input"), default=str)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        lines.append(f"{path or 'body'}: {err.get('msg')} (input: {shown})")
    count = len(errors)
    head = f"{count} validation error{'s' if count != 1 else ''}"
    return f"{head}: " + "; ".join(lines), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = format_validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(ParamError)
    async def _param(_: Request, exc: ParamError):
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        status = exc.status_code
        if status == 404:
            message = "Not Found: no such route."
        elif status == 405:
            message = "Method Not Allowed."
        else:
            message = str(exc.detail)
        return error_response(status, message, None, exc.headers)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError):
        err = map_engine_exception(exc)
        return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        err = engine_dead()
        return JSONResponse(err.envelope(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestTimeout)
    async def _timeout(_: Request, exc: RequestTimeout):
        return error_response(504, str(exc))

    @app.exception_handler(EngineRequestError)
    async def _engine_request(_: Request, exc: EngineRequestError):
        # the engine's own message, as the streaming path reports it
        return error_response(500, f"The engine failed on this request: {exc}")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"Internal error: {type(exc).__name__}")
