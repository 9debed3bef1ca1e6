"""Errors that services raise and the gRPC edge maps to status codes (one mapping, in grpc_host)."""


class InvalidArgument(ValueError):
    """The caller sent something that cannot be served: INVALID_ARGUMENT."""


class ResourceExhausted(RuntimeError):
    """No room right now (KV cache, queue): RESOURCE_EXHAUSTED."""


class Unavailable(RuntimeError):
    """The service is loading, draining or lost a dependency: UNAVAILABLE."""
