"""asyncio face of kvbank.Client: the transfers as coroutines, run on the client's threads.

    client = kvbank.aio.AsyncClient(kvbank.Client(target))
    info = await client.fetch_into(model, seq_id, out)

Each call runs the blocking call on the client's worker threads (GIL released during the RPC),
so the event loop keeps running; several awaited together overlap.
"""

import asyncio
from typing import Any, Union

import numpy as np

from ._client import Client, FetchInfo, SequenceInfo


class AsyncClient:
    def __init__(self, client: Client):
        self.client = client

    async def append(self, model: str, seq_id: int, payload: Any = None,
                     **kwargs: Any) -> SequenceInfo:
        return await asyncio.wrap_future(self.client.append_async(model, seq_id, payload,
                                                                  **kwargs))

    async def fetch(self, model: str, seq_id: int, **kwargs: Any) -> Union[np.ndarray, bytes]:
        return await asyncio.wrap_future(self.client.fetch_async(model, seq_id, **kwargs))

    async def fetch_into(self, model: str, seq_id: int, out: Any, **kwargs: Any) -> FetchInfo:
        return await asyncio.wrap_future(self.client.fetch_into_async(model, seq_id, out,
                                                                      **kwargs))

    def __getattr__(self, name: str) -> Any:
        """Any other method of Client, as a coroutine run on a worker thread."""
        method = getattr(self.client, name)
        if not callable(method):
            return method

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.wrap_future(self.client._submit(method, *args, **kwargs))

        return call
