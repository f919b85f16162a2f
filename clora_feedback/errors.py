"""The one exception hierarchy of clora-feedback.

Every error raised on purpose by this package derives from `CloraError` and
carries its behaviour as attributes, so callers never match on message text:

    CloraError                      http_status=500, retriable=False
    ├── InvalidRequestError         400  a request parameter is wrong (names `param`)
    │   ├── ContextLengthError      400  prompt + max_tokens exceed the context window
    │   ├── PayloadTooLargeError    413  a request body over the configured limit
    │   └── UnprocessableError      422  well-formed, but can never apply (e.g. feedback
    │                                    about another agent's completion)
    ├── AuthenticationError         401  missing or unknown API key
    ├── PermissionDeniedError       403  the key may not touch this agent or route
    ├── NotFoundError               404  unknown agent, model, adapter or completion
    ├── ConflictError               409  state conflict (e.g. adapter already loaded)
    ├── GoneError                   410  it existed, its payload was removed (a pruned
    │                                    adapter version: manifest kept, weights gone)
    ├── OverloadedError             429  the request queue is full (retriable)
    ├── AdapterError                400  an adapter is malformed or exceeds engine limits
    │   └── BaseMismatchError       400  an adapter made for another base model (weights,
    │                                    tokenizer or chat template digests differ)
    ├── EngineError                 500  the engine failed while generating
    ├── StoreError                  500  durable storage failed (retriable)
    │   └── IntegrityError          500  stored content is corrupt (not retriable)
    ├── ConfigError                 500  the settings ask for something this build cannot do
    │                                    (e.g. an engine kind not available yet)
    └── UnavailableError            503  a dependency is unreachable: the Kafka cluster,
        │                                the local broker, the gateway (retriable)
        └── EngineUnavailableError  503  a remote engine (a vLLM server) timed out or
                                         cannot be reached; carries `retry_after_s`

The gateway maps these to OpenAI error JSON in exactly one place
(`clora_feedback.gateway.errors`); foreign exceptions are translated once at
the boundary where they enter (`raise ... from exc`).
"""

from __future__ import annotations


class CloraError(Exception):
    """Base class. `http_status`, `error_type` and `retriable` describe behaviour;
    `retry_after_s`, when set, is the wait a client is told (`Retry-After`)."""

    http_status: int = 500
    error_type: str = "server_error"
    retriable: bool = False
    retry_after_s: float | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(CloraError):
    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class PayloadTooLargeError(InvalidRequestError):
    http_status = 413


class UnprocessableError(InvalidRequestError):
    http_status = 422


class AuthenticationError(CloraError):
    http_status = 401
    error_type = "authentication_error"


class PermissionDeniedError(CloraError):
    http_status = 403
    error_type = "permission_error"


class NotFoundError(CloraError):
    http_status = 404
    error_type = "not_found_error"


class ConflictError(CloraError):
    http_status = 409
    error_type = "conflict_error"


class GoneError(CloraError):
    http_status = 410
    error_type = "not_found_error"


class OverloadedError(CloraError):
    http_status = 429
    error_type = "rate_limit_error"
    retriable = True
    retry_after_s: float

    def __init__(self, message: str, *, retry_after_s: float = 1.0, code: str = "overloaded"):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class AdapterError(CloraError):
    http_status = 400
    error_type = "invalid_request_error"


class BaseMismatchError(AdapterError):
    """An adapter recorded for another base model; `differs` names what (e.g. `tokenizer`)."""

    def __init__(self, message: str, *, differs: tuple[str, ...], param: str | None = None):
        super().__init__(message, param=param, code="base_mismatch")
        self.differs = differs


class EngineError(CloraError):
    http_status = 500
    error_type = "server_error"


class StoreError(CloraError):
    http_status = 500
    error_type = "server_error"
    retriable = True


class IntegrityError(StoreError):
    retriable = False


class ConfigError(CloraError):
    http_status = 500
    error_type = "server_error"


class UnavailableError(CloraError):
    http_status = 503
    error_type = "server_error"
    retriable = True


class EngineUnavailableError(UnavailableError):
    """The serving engine's server timed out or refused the connection; retry shortly."""

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, code: str = "engine_unavailable"
    ):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s
