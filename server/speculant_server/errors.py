"""OpenAI-shaped API errors, in a module of their own that imports nothing heavy: the Ray Serve
ingress answers with them without loading torch (protocol.py re-exports both names)."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or self.TYPES.get(status, "server_error")
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.status, **self.extra}}


def bad(message: str, **extra: Any) -> ApiError:
    return ApiError(400, message, **extra)
