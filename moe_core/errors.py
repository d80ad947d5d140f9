"""The errors both services report about a request, whichever transport carried it. The front ends map them
to their own codes (gRPC's status codes, whose names and numbers these are; HTTP statuses)."""
from __future__ import annotations

import enum


class Status(enum.Enum):
    """Why a request failed (gRPC's codes: grpc.StatusCode[status.name] is the same code)."""
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


def http_status(status: Status) -> int:
    """The HTTP status a failed request's Status answers with on the HTTP APIs."""
    return {Status.INVALID_ARGUMENT: 400, Status.UNAVAILABLE: 503, Status.DEADLINE_EXCEEDED: 504,
            Status.RESOURCE_EXHAUSTED: 429}.get(status, 500)


class BadRequest(ValueError):
    """A request that cannot be served as asked (INVALID_ARGUMENT, HTTP 400). field: the field at fault, as the
    transport-neutral request names it (dotted: "sampling.top_p"; "" when it is the request as a whole); the
    message starts with it. code: a machine-readable reason where one exists (OpenAI's
    "context_length_exceeded")."""

    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.detail, self.code = field, message, code

    def named(self, names: dict[str, str]) -> str:
        """The message with the field as a front end names it (names: neutral name -> its own; others kept)."""
        field = names.get(self.field, self.field)
        return f"{field}: {self.detail}" if field else self.detail


class ModelConfigError(ValueError):
    """The checkpoint directory or its config.json cannot be served."""
