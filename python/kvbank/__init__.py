"""kvbank: the Python SDK of the kvbank KV-cache service (bindings of the C++ SDK).

    import kvbank
    client = kvbank.Client("127.0.0.1:50051")
    model = client.ensure_model(preset="llama-3.1-8b", name="llama")
    seq = client.create_sequence("llama", prompt=token_ids)
    client.append("llama", seq.id, payload, num_tokens=len(token_ids))
    client.fetch_into("llama", seq.id, out)   # straight into a numpy array or CPU tensor

    fleet = kvbank.Fleet("dns:///kvbank-headless.ns:50051")   # several replicas, one object

Errors raise kvbank.Error subclasses named after the gRPC code (kvbank.NotFoundError, ...).
"""

from . import aio as aio  # kvbank.aio.AsyncClient after a plain `import kvbank`
from ._client import (
    MAX_REGION_RUNS,
    Client,
    chain_hash,
    cuda_ipc_handle,
    layout_fingerprint,
    normalize_layout,
    numpy_dtype,
    prefix_hashes,
    preset_layout,
    preset_names,
    root_hash,
)
from ._device import DEVICE_PLANES, choose_device_plane
from ._errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)
from ._fleet import Fleet

# The project's version, written once: project(kvbank VERSION ...) in the repository's
# CMakeLists.txt, compiled into the extension (the package metadata carries the same).
from ._kvbank import __version__ as __version__

# The result types, whose instances the extension builds (python/src/convert.cc).
from ._types import (
    Blocks,
    DeviceRegion,
    Event,
    FetchInfo,
    FleetSequence,
    ModelInfo,
    PrefixRoot,
    Replica,
    Route,
    SequenceInfo,
)

__all__ = [
    "AbortedError", "AlreadyExistsError", "Blocks", "CancelledError", "Client", "DataLossError",
    "DeadlineExceededError", "DeviceRegion", "Error", "Event", "FailedPreconditionError",
    "FetchInfo", "Fleet", "FleetSequence", "Replica", "Route",
    "InternalError", "InvalidArgumentError", "ModelInfo", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "PrefixRoot", "ResourceExhaustedError", "SequenceInfo",
    "UnauthenticatedError", "UnavailableError", "UnimplementedError", "UnknownError",
    "DEVICE_PLANES", "MAX_REGION_RUNS", "chain_hash", "choose_device_plane", "cuda_ipc_handle",
    "layout_fingerprint",
    "normalize_layout", "numpy_dtype", "prefix_hashes", "preset_layout", "preset_names",
    "root_hash",
]
