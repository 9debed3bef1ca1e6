"""Errors that services raise and the gRPC edge maps to status codes (one mapping, in grpc_host)."""


class InvalidArgument(ValueError):
    """The caller sent something that cannot be served: INVALID_ARGUMENT. `param` names the
    request field at fault, when one is (REST errors carry it as `param`)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ResourceExhausted(RuntimeError):
    """No room right now (KV cache, queue): RESOURCE_EXHAUSTED."""


class Unavailable(RuntimeError):
    """The service is loading, draining or lost a dependency: UNAVAILABLE."""
