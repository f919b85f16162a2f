"""The OpenAI error body as a wire model, for documenting every error status.

Every failure the gateway answers is `{"error": {"message", "type", "param", "code"}}`
(built in `clora_feedback.gateway.errors`); these models give that shape a name
in the served `/openapi.json` (`ErrorResponse`, as the official OpenAI
description calls it).

Not here: building error bodies (`gateway.errors`), the error tree (`clora_feedback.errors`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ErrorObject(BaseModel):
    """One error, as OpenAI sends it."""

    model_config = ConfigDict(extra="allow")

    message: str = Field(description="What went wrong, for a person to read.")
    type: str = Field(
        description="The error family: invalid_request_error, authentication_error, "
        "permission_error, not_found_error, conflict_error, rate_limit_error, server_error."
    )
    param: str | None = Field(
        description="The request parameter at fault, e.g. `messages[0].content`."
    )
    code: str | None = Field(description="A stable machine-readable code, e.g. `model_not_found`.")


class ErrorResponse(BaseModel):
    """Every non-2xx JSON answer of the gateway."""

    model_config = ConfigDict(extra="allow")

    error: ErrorObject
