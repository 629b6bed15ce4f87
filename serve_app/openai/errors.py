"""OpenAI-style errors, and the Starlette exception handlers that make sure whatever goes
wrong, the client gets an OpenAI error body."""

from __future__ import annotations

import logging

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

logger = logging.getLogger("serve_app.http")


class APIError(Exception):
    """A client-visible error: HTTP status plus the OpenAI `error` object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def _api_error(request: HTTPRequest, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _not_found(request: HTTPRequest, exc) -> Response:
    return JSONResponse(APIError(404, "no such route", code="not_found").body(), status_code=404)


async def _method_not_allowed(request: HTTPRequest, exc) -> Response:
    err = APIError(405, "method not allowed on this route", code="method_not_allowed")
    return JSONResponse(err.body(), status_code=405)


async def _internal(request: HTTPRequest, exc: Exception) -> Response:
    logger.exception("unhandled error serving %s", request.url.path)
    err = APIError(500, "internal server error", "server_error", code="internal_error")
    return JSONResponse(err.body(), status_code=500)


EXCEPTION_HANDLERS = {APIError: _api_error, 404: _not_found, 405: _method_not_allowed, Exception: _internal}
