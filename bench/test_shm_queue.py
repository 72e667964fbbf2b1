"""One step's RPC round trip (encode, enqueue, dequeue and decode in a worker process, reply,
dequeue and decode the reply) for a SchedulerOutput of 256 decode requests: the shared-memory
queue against a plain ZMQ socket and pickle over multiprocessing.Queue, in the same run; then
the same sizes as opaque bytes (the transport alone). extra_info: message sizes, p50/p99, and
for the baselines `p50_over_shm` (their median over the shm queue's, same run). Compare those
ratios, never numbers from another day. The step case records in `meets_target` whether the
mp.Queue ratio reaches MIN_SPEEDUP_OVER_MP_QUEUE; it does not assert it, because on 2 cores any
other load shares a core with the reader and inflates the shm queue's median."""

from __future__ import annotations

import statistics

import pytest

from shm_queue_workload import (TRANSPORTS, decode_step, msgpack_sizes, raw_request,
                                runner_output)

NUM_REQS = 256
ROUNDS = 2000
# Issue 6's bar: the shm step round trip's median at least this many times below pickle over
# multiprocessing.Queue's, measured in the same run on idle cores.
MIN_SPEEDUP_OVER_MP_QUEUE = 10.0
_SHM_P50: dict[str, float] = {}  # group -> the shm queue's median in this run


@pytest.fixture(scope="module")
def transports():
    started = {name: cls() for name, cls in TRANSPORTS.items()}
    for transport in started.values():  # every server up (not importing) before any timing
        transport.round_trip(decode_step(1))
    yield started
    for transport in started.values():
        transport.close()


def _record(benchmark, transport: str) -> None:
    if benchmark.stats is None:  # --benchmark-disable: the case ran once, untimed
        return
    data = sorted(benchmark.stats.stats.data)
    p50 = statistics.median(data)
    p99 = data[int(0.99 * (len(data) - 1))]
    info = {"p50_us": round(p50 * 1e6, 1), "p99_us": round(p99 * 1e6, 1)}
    if transport == "shm":
        _SHM_P50[benchmark.group] = p50
    elif benchmark.group in _SHM_P50:
        info["p50_over_shm"] = round(p50 / _SHM_P50[benchmark.group], 2)
    benchmark.extra_info.update(info)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_step_round_trip(benchmark, transports, transport):
    benchmark.group = f"step-rpc-round-trip-{NUM_REQS}"
    t = transports[transport]
    sched = decode_step(NUM_REQS)
    expected = runner_output(sched)
    assert t.round_trip(sched) == expected
    benchmark.extra_info.update(num_reqs=NUM_REQS, transport=transport, **t.sizes(sched))
    result = benchmark.pedantic(t.round_trip, args=(sched,), rounds=ROUNDS, warmup_rounds=50)
    assert result == expected
    _record(benchmark, transport)
    ratio = benchmark.extra_info.get("p50_over_shm")
    if transport == "mp_queue" and ratio is not None:
        benchmark.extra_info["meets_target"] = ratio >= MIN_SPEEDUP_OVER_MP_QUEUE


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_transport_round_trip(benchmark, transports, transport):
    """The same sizes as the step above, as opaque bytes: the transport alone."""
    t = transports[transport]
    sizes = msgpack_sizes(decode_step(NUM_REQS))
    benchmark.group = f"transport-round-trip-{sizes['request_bytes']}B"
    request = raw_request(sizes["request_bytes"], sizes["reply_bytes"])
    assert t.raw_round_trip(request) == sizes["reply_bytes"]
    benchmark.extra_info.update(transport=transport, **sizes)
    benchmark.pedantic(t.raw_round_trip, args=(request,), rounds=ROUNDS, warmup_rounds=50)
    _record(benchmark, transport)
