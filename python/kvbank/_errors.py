"""Typed exceptions: one class per gRPC status code, all deriving from kvbank.Error."""



class Error(Exception):
    """A failed kvbank call. `code` is the gRPC status code (int), `code_name` its name
    ("NOT_FOUND"), `message` the server's (or the SDK's) message, unchanged."""

    code: int = 2
    code_name: str = "UNKNOWN"

    def __init__(self, message: str = "", code: "int | None" = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
            self.code_name = _NAMES.get(code, "UNKNOWN")

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


class CancelledError(Error):
    code, code_name = 1, "CANCELLED"


class UnknownError(Error):
    code, code_name = 2, "UNKNOWN"


class InvalidArgumentError(Error, ValueError):
    code, code_name = 3, "INVALID_ARGUMENT"


class DeadlineExceededError(Error, TimeoutError):
    code, code_name = 4, "DEADLINE_EXCEEDED"


class NotFoundError(Error, LookupError):
    code, code_name = 5, "NOT_FOUND"


class AlreadyExistsError(Error):
    code, code_name = 6, "ALREADY_EXISTS"


class PermissionDeniedError(Error, PermissionError):
    code, code_name = 7, "PERMISSION_DENIED"


class ResourceExhaustedError(Error):
    code, code_name = 8, "RESOURCE_EXHAUSTED"


class FailedPreconditionError(Error):
    code, code_name = 9, "FAILED_PRECONDITION"


class AbortedError(Error):
    code, code_name = 10, "ABORTED"


class OutOfRangeError(Error, IndexError):
    code, code_name = 11, "OUT_OF_RANGE"


class UnimplementedError(Error, NotImplementedError):
    code, code_name = 12, "UNIMPLEMENTED"


class InternalError(Error):
    code, code_name = 13, "INTERNAL"


class UnavailableError(Error, ConnectionError):
    code, code_name = 14, "UNAVAILABLE"


class DataLossError(Error):
    code, code_name = 15, "DATA_LOSS"


class UnauthenticatedError(Error):
    code, code_name = 16, "UNAUTHENTICATED"


_BY_CODE: dict[int, type[Error]] = {
    cls.code: cls
    for cls in (CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError,
                NotFoundError, AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError,
                FailedPreconditionError, AbortedError, OutOfRangeError, UnimplementedError,
                InternalError, UnavailableError, DataLossError, UnauthenticatedError)
}
_NAMES = {code: cls.code_name for code, cls in _BY_CODE.items()}


def from_status(code: int, message: str) -> Error:
    """The exception for a non-OK status (used by the extension module)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return Error(message, code)
    return cls(message)
