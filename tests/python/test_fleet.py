"""kvbank.Fleet over three real kvbankd on loopback: placement by prefix, routed Match and
prefix roots, calls pinned to a sequence's replica, a killed replica's sequences failing with
UnavailableError naming it, merged KV events."""

import signal
import threading

import numpy as np
import pytest

import kvbank

from kvbankd_process import Server

LAYOUT = {"name": "fleet", "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16,
          "dtype": "fp16"}
BT = 16


@pytest.fixture
def replicas():
    servers = [Server([f"--replica-name=py-{i}", "--pool-bytes=16MiB"]) for i in range(3)]
    yield servers
    for s in servers:
        if s.proc.poll() is None:
            s.stop()


def tokens(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 128000, n)]


def kv(model, n, seed=0):
    count = model.payload_bytes(n) // 2
    return np.random.default_rng(seed).uniform(-1, 1, count).astype(np.float16)


def test_fleet_places_by_prefix_and_pins_sequences(replicas):
    fleet = kvbank.Fleet(",".join(s.target for s in replicas), probe_interval_s=0.1)
    assert [r.name for r in fleet.replicas()] == ["py-0", "py-1", "py-2"]
    assert all(r.healthy for r in fleet.replicas())
    model = fleet.ensure_model(LAYOUT, pool_bytes=4 << 20)

    # The root is the same on every replica and the one computed here.
    root = fleet.prefix_root("fleet")
    for s in replicas:
        assert kvbank.Client(s.target).get_prefix_root("fleet").root == root.root
    assert fleet.get_prefix_root("fleet").root == root.root

    used = set()
    for p in range(9):
        prefix = tokens(100 + p, 2 * BT)
        a = fleet.create_sequence("fleet", prompt=prefix + tokens(200 + p, 5))
        data = kv(model, len(prefix) + 5, seed=p)
        fleet.append(a, data, num_tokens=len(prefix) + 5,
                     token_ids=prefix + tokens(200 + p, 5))
        np.testing.assert_array_equal(fleet.fetch(a), data)
        out = np.empty_like(data)
        assert fleet.fetch_into(a, out).payload_bytes == data.nbytes
        assert out.tobytes() == data.tobytes()
        fork = fleet.fork(a)
        assert fork.replica == a.replica and fork.id != a.id
        assert fleet.truncate(fork, BT).length == BT
        assert fleet.free(fork) > 0
        assert fleet.free(a) > 0

        b = fleet.create_sequence("fleet", prompt=prefix + tokens(300 + p, 9))
        assert b.replica == a.replica
        assert b.info.cached_tokens == 2 * BT
        assert fleet.get_sequence(b).id == b.id
        fleet.free(b)
        assert fleet.match("fleet", [prefix + tokens(400 + p, 3)]) == [2 * BT]
        assert fleet.replica_for(fleet.placement_key("fleet", prefix)) == a.replica
        used.add(a.replica)
    assert used == {"py-0", "py-1", "py-2"}


def test_fleet_killed_replica_fails_only_its_sequences(replicas):
    fleet = kvbank.Fleet(",".join(s.target for s in replicas), probe_interval_s=0.1)
    model = fleet.ensure_model(LAYOUT, pool_bytes=4 << 20)
    seqs = []
    for i in range(30):
        prompt = tokens(1000 + i, BT)
        seq = fleet.create_sequence("fleet", prompt=prompt)
        fleet.append(seq, kv(model, BT, seed=i), num_tokens=BT, token_ids=prompt)
        seqs.append(seq)
    victim = seqs[0].replica
    server = replicas[int(victim[-1])]
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=10)

    for seq in seqs:
        if seq.replica == victim:
            with pytest.raises(kvbank.UnavailableError) as e:
                fleet.get_sequence(seq)
            assert f"replica {victim}" in e.value.message
            assert f"sequence {seq.id}" in e.value.message
        else:
            assert fleet.get_sequence(seq).length == BT
    # New placements all succeed, none on the victim.
    for i in range(30):
        seq = fleet.create_sequence("fleet", prompt=tokens(2000 + i, BT))
        assert seq.replica != victim
        fleet.free(seq)
    health = {r.name: r.healthy for r in fleet.replicas()}
    assert health[victim] is False
    assert sum(health.values()) == 2


def test_fleet_watch_tags_events_with_replica(replicas):
    fleet = kvbank.Fleet(",".join(s.target for s in replicas), probe_interval_s=0.1)
    model = fleet.ensure_model(LAYOUT, pool_bytes=4 << 20)
    prompts = [tokens(3000 + i, BT) for i in range(6)]
    want = {fleet.placement_key("fleet", p): fleet.replica_for(fleet.placement_key("fleet", p))
            for p in prompts}
    seen = {}

    def on_batch(replica, events):
        for e in events:
            if e.type == "stored":
                for h in e.hashes:
                    seen[h] = replica
        return not all(k in seen for k in want)

    result: dict[str, bool] = {}
    watcher = threading.Thread(
        target=lambda: result.setdefault("stopped", fleet.watch("fleet", on_batch,
                                                                 deadline_s=30)))
    watcher.start()
    for i, p in enumerate(prompts):
        seq = fleet.create_sequence("fleet", prompt=p)
        fleet.append(seq, kv(model, BT, seed=i), num_tokens=BT, token_ids=p)
        fleet.free(seq)
    watcher.join()
    assert result["stopped"] is True
    for key, replica in want.items():
        assert seen[key] == replica


def test_fleet_bad_target():
    with pytest.raises(kvbank.InvalidArgumentError):
        kvbank.Fleet("127.0.0.1")
    with pytest.raises(kvbank.InvalidArgumentError):
        kvbank.Fleet("dns://authority/name:1")


def test_fleet_and_client_refuse_bad_arguments_alike(replicas):
    """The Fleet and the Client share one set of converters: the same bad argument raises the
    same InvalidArgumentError, with the same message, before any RPC."""
    fleet = kvbank.Fleet(",".join(s.target for s in replicas), probe_interval_s=0.1)
    client = kvbank.Client(replicas[0].target)
    fleet.ensure_model(LAYOUT, pool_bytes=4 << 20)
    seq = fleet.create_sequence("fleet", prompt=tokens(7, BT))
    client_seq = client.create_sequence("fleet")

    cases = [
        ("unknown dtype 'fp64' (fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2)",
         lambda: fleet.fetch(seq, dtype="fp64"),
         lambda: client.fetch("fleet", client_seq.id, dtype="fp64")),
        ("wait_s must be within [0, 600] seconds",
         lambda: fleet.fetch(seq, wait_s=601.0),
         lambda: client.fetch("fleet", client_seq.id, wait_s=601.0)),
        ("a block hash is 32 bytes, not 3",
         lambda: fleet.fetch_blocks("fleet", [b"abc"]),
         lambda: client.fetch_blocks("fleet", [b"abc"])),
        ("unknown layout field 'heads'",
         lambda: fleet.ensure_model({"name": "y", "heads": 2}),
         lambda: client.ensure_model({"name": "y", "heads": 2})),
    ]
    for message, via_fleet, via_client in cases:
        for call in (via_fleet, via_client):
            with pytest.raises(kvbank.InvalidArgumentError) as e:
                call()
            assert e.value.message == message
            assert isinstance(e.value, ValueError)

    # A layout dict that leaves fields out gets the same defaults from both (head_dim_v from
    # head_dim, layer dtypes from "dtype"), so both register the same model.
    partial = {"name": "partial", "num_layers": 3, "num_q_heads": 2, "num_kv_heads": 1,
               "head_dim": 8, "dtype": "bf16"}
    registered = fleet.ensure_model(partial, pool_bytes=1 << 20)
    assert registered.layout["head_dim_v"] == 8
    assert registered.layout["layer_dtypes"] == ["bf16"] * 3
    assert client.get_model("partial").fingerprint == registered.fingerprint
    fleet.free(seq)


@pytest.mark.parametrize("n", [3, 8])
def test_fleet_spreads_a_hot_system_prompt_within_the_bound(n):
    servers = [Server([f"--replica-name=hot-{i}", "--pool-bytes=16MiB"]) for i in range(n)]
    try:
        fleet = kvbank.Fleet(",".join(s.target for s in servers), probe_interval_s=0.1)
        model = fleet.ensure_model(LAYOUT, pool_bytes=8 << 20)
        system = tokens(1, 4 * BT)
        first = fleet.route("fleet", system + tokens(2, 50))
        assert (first.reason, first.replica, first.cached_tokens) == ("home", first.home, 0)
        assert first.cost == first.prompt_tokens == 4 * BT + 50

        placed: dict[str, int] = {}
        cached = 0
        requests = 40 * n
        for i in range(requests):
            prompt = system + tokens(1000 + i, 50)
            seq = fleet.create_sequence("fleet", prompt=prompt)
            placed[seq.replica] = placed.get(seq.replica, 0) + 1
            cached += seq.info.cached_tokens
            rest = len(prompt) - seq.info.cached_tokens
            fleet.append(seq, kv(model, rest, seed=i), num_tokens=rest,
                         token_ids=prompt[seq.info.cached_tokens:])
        # Every replica within 15 % of the mean; without the bound all would sit on one.
        mean = requests / n
        assert len(placed) == n
        assert all(abs(c - mean) <= 0.15 * mean for c in placed.values()), placed
        # The system prompt was copied once to each other replica, never recomputed.
        assert cached == 4 * BT * (requests - 1)
        stats = fleet.stats()
        assert stats["placements"] == requests
        assert stats["prefix_copies"] == n - 1
        assert stats["copied_bytes"] == (n - 1) * model.payload_bytes(4 * BT)
        assert stats["copy_failures"] == 0
        # The replicas count what came in as copies, in GetStats (and /metrics).
        came_in = [kvbank.Client(s.target).stats("fleet")[0] for s in servers]
        assert sum(m["prefix_copies_in"] for m in came_in) == n - 1
        assert sum(m["prefix_copy_bytes_in"] for m in came_in) == stats["copied_bytes"]

        # Route says where the next one goes, with the loads it was decided on.
        r = fleet.route("fleet", system + tokens(3, 50))
        assert isinstance(r, kvbank.Route) and r.home == first.home
        assert r.mean_load == pytest.approx((requests + 1) / n, rel=0.2)
        assert r.cached_tokens == 4 * BT and r.cost == 50
        assert r.reason in ("home", "over_load_bound")
        assert (r.replica == r.home) == (r.reason == "home")

        by_key = kvbank.Fleet(",".join(s.target for s in servers), load_epsilon=None)
        assert by_key.route("fleet", system + tokens(3, 50)).replica == first.home
        with pytest.raises(kvbank.InvalidArgumentError):
            kvbank.Fleet(servers[0].target, load_epsilon=-1.0)
    finally:
        for s in servers:
            s.stop()
