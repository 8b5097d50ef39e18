"""Error categories of the Tinker wire: a failed future carries ``{"error": msg, "category": ...}``
and the SDK raises ``RequestFailedError`` with that category. A `UserError` is the client's fault
(bad payload, unknown loss, unknown model); anything else is reported as a server error. Neither
stops the server."""
from __future__ import annotations


class UserError(ValueError):
    """A request the client must fix; the message names the datum / field / key at fault."""

    category = "user"


def failure_body(exc: BaseException) -> dict:
    """The retrieve_future body of a failed request."""
    if isinstance(exc, UserError):
        return {"error": str(exc), "category": "user"}
    return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
