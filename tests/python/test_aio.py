"""kvbank.aio.AsyncClient: the same surface as kvbank.Client, awaited, against the real kvbankd;
closing (aclose, `async with`) waits for the calls in flight off the client's own threads."""

import asyncio
import inspect
import threading
import typing

import numpy as np
import pytest

import kvbank
from kvbank.aio import AsyncClient

# Client methods whose counterpart has another name or kind.
RENAMED = {"close": "aclose"}


def _public(cls):
    return {name: attr for name, attr in vars(cls).items() if not name.startswith("_")}


def _counterpart(name):
    """The AsyncClient name of a Client method: *_async (futures) map to the coroutine of the
    plain name."""
    if name.endswith("_async"):
        return name[:-len("_async")]
    return RENAMED.get(name, name)


def test_every_client_method_has_an_async_counterpart():
    sync, aio = _public(kvbank.Client), _public(AsyncClient)
    for name, attr in sync.items():
        twin = aio.get(_counterpart(name))
        assert twin is not None, f"AsyncClient has no counterpart of Client.{name}"
        if isinstance(attr, property):
            assert isinstance(twin, property), name
            continue
        if name.endswith("_async"):
            continue  # the counterpart is checked under its plain name
        if inspect.isgeneratorfunction(attr):
            assert inspect.isasyncgenfunction(twin), f"AsyncClient.{name} is not async-iterable"
        else:
            assert inspect.iscoroutinefunction(twin), f"AsyncClient.{name} is not a coroutine"
        assert twin.__doc__ and f"Client.{name}" in twin.__doc__.splitlines()[0], name
        if name in RENAMED:
            continue
        # The same parameters: names, kinds, defaults and types.
        want, got = inspect.signature(attr), inspect.signature(twin)
        assert [(p.name, p.kind, p.default) for p in want.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in got.parameters.values()], name
        want_hints, got_hints = typing.get_type_hints(attr), typing.get_type_hints(twin)
        want_return, got_return = want_hints.pop("return"), got_hints.pop("return")
        assert want_hints == got_hints, name
        if inspect.isgeneratorfunction(attr):  # Iterator[T] -> AsyncIterator[T]
            assert typing.get_args(want_return) == typing.get_args(got_return), name
        else:
            assert want_return == got_return, name
    # Nothing AsyncClient offers that Client does not (the client itself and target aside).
    extra = set(aio) - {_counterpart(n) for n in sync} - {"target"}
    assert not extra, f"AsyncClient methods without a Client counterpart: {sorted(extra)}"


def test_every_argument_reaches_the_client_method(client):
    """Each coroutine hands every argument to the Client method of its name, by name."""
    calls = {}

    def recorder(name):
        def record(*args, **kwargs):
            method = getattr(kvbank.Client, name)
            calls[name] = inspect.signature(method).bind(client, *args, **kwargs).arguments
            return iter(()) if name == "watch" else None
        return record

    aclient = AsyncClient(client)

    async def main():
        for name, attr in _public(AsyncClient).items():
            if name in ("aclose", "target") or isinstance(attr, property):
                continue
            params = list(inspect.signature(getattr(kvbank.Client, name)).parameters)[1:]
            args = {p: f"<{name}.{p}>" for p in params}
            setattr(client, name, recorder(name))
            if inspect.isasyncgenfunction(attr):
                assert [e async for e in getattr(aclient, name)(**args)] == []
            else:
                await getattr(aclient, name)(**args)
            got = dict(calls.pop(name))
            got.pop("self")
            assert got == args, name

    try:
        asyncio.run(main())
    finally:
        for name in _public(AsyncClient):
            client.__dict__.pop(name, None)


def _layout(name):
    return {"name": name, "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32,
            "block_tokens": 16, "dtype": "fp16"}


def test_awaited_calls_against_kvbankd(server, model_name):
    rng = np.random.default_rng(7101)

    async def main():
        async with AsyncClient(kvbank.Client(server.target)) as aclient:
            await aclient.check_serving()
            model = await aclient.ensure_model(_layout(model_name))
            assert model.created and model.name == model_name
            assert model_name in [m.name for m in await aclient.list_models()]

            # Several sequences created and appended at once.
            n = 37
            payloads = [rng.standard_normal(model.payload_bytes(n) // 2).astype(np.float16)
                        for _ in range(3)]
            seqs = await asyncio.gather(*(aclient.create_sequence(model_name) for _ in payloads))
            assert len({s.id for s in seqs}) == 3
            infos = await asyncio.gather(*(aclient.append(model_name, s.id, p, num_tokens=n)
                                           for s, p in zip(seqs, payloads)))
            assert [i.length for i in infos] == [n] * 3

            # Fetched back at once, straight into arrays.
            outs = [np.zeros_like(p) for p in payloads]
            fetched = await asyncio.gather(*(aclient.fetch_into(model_name, s.id, o)
                                             for s, o in zip(seqs, outs)))
            for info, out, payload in zip(fetched, outs, payloads):
                assert info.payload_bytes == payload.nbytes
                assert out.tobytes() == payload.tobytes()
            got = await aclient.fetch(model_name, seqs[0].id)
            assert got.tobytes() == payloads[0].tobytes()
            raw = await aclient.fetch(model_name, seqs[0].id, as_bytes=True)
            assert raw == payloads[0].tobytes()
            assert (await aclient.get_sequence(model_name, seqs[1].id)).length == n
            assert (await aclient.truncate(model_name, seqs[1].id, 16)).length == 16

            # Errors raise the same typed exceptions as the Client's.
            with pytest.raises(kvbank.NotFoundError):
                await aclient.get_sequence(model_name, 987654321)
            with pytest.raises(kvbank.InvalidArgumentError):
                await aclient.append(model_name, seqs[0].id, payloads[0][:10], num_tokens=1)

            freed = await asyncio.gather(*(aclient.free(model_name, s.id) for s in seqs))
            assert all(f > 0 for f in freed)
            return aclient

    aclient = asyncio.run(main())
    # Leaving `async with` closed the client: its worker threads are gone.
    assert aclient.client._pool is None


def test_watch_is_an_async_iterator(client, model_name):
    bt = 16
    model = client.ensure_model(_layout(model_name))
    aclient = AsyncClient(client)
    prompt = list(range(2000, 2000 + 2 * bt))
    root = client.get_prefix_root(model_name)
    hashes = kvbank.prefix_hashes(root.root, prompt, bt, algorithm=root.algorithm)
    payload = np.zeros(model.payload_bytes(len(prompt)) // 2, np.float16)

    async def main():
        seq = await aclient.create_sequence(model_name, prompt)
        await aclient.append(model_name, seq.id, payload, num_tokens=len(prompt))
        stored = []
        async for event in aclient.watch(model_name, after_sequence=0, deadline_s=30.0):
            if event.type == "stored":
                stored += event.hashes
            if len(stored) >= len(hashes):
                break
        return stored

    assert asyncio.run(main())[:len(hashes)] == hashes


def test_aclose_waits_for_calls_in_flight_off_the_client_threads(server, model_name):
    client = kvbank.Client(server.target, max_workers=2)
    model = client.ensure_model(_layout(model_name))
    seq = client.create_sequence(model_name)
    payload = np.ones(model.payload_bytes(64) // 2, np.float16)
    client.append(model_name, seq.id, payload, num_tokens=64)

    # close joins the client's worker threads: it must run on some other thread.
    closed_on = []
    close = client.close

    def recording_close():
        closed_on.append(threading.current_thread().name)
        close()

    client.close = recording_close  # type: ignore[method-assign]  # spies on the instance

    async def main():
        aclient = AsyncClient(client)
        outs = [np.zeros_like(payload) for _ in range(6)]  # more calls than workers
        fetches = asyncio.gather(*(aclient.fetch_into(model_name, seq.id, o) for o in outs))
        await asyncio.sleep(0)  # the fetches are submitted
        await asyncio.wait_for(aclient.aclose(), timeout=60)
        infos = await fetches
        assert all(o.tobytes() == payload.tobytes() for o in outs)
        assert all(i.payload_bytes == payload.nbytes for i in infos)
        # The client stays usable: the next call starts new workers.
        assert (await aclient.get_sequence(model_name, seq.id)).length == 64
        await aclient.aclose()

    asyncio.run(main())
    assert len(closed_on) == 2
    assert not any(name.startswith("kvbank") for name in closed_on), closed_on
    assert client._pool is None
