"""AsyncLLM over an engine-core process: concurrent streams, abort, cancellation, failure.

One AsyncLLM (and core process) serves the module, on one event loop; the last test shuts it
down. Killing the core has its own. Tests that must catch a request mid-flight freeze the core
with SIGSTOP first: the tiny model finishes a request in well under a second.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager

import pytest

from mrv2 import LLM
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.async_llm import AsyncLLM
from mrv2.engine.client import RequestRejectedError
from mrv2.engine.input_processor import PromptError
from mrv2.errors import EngineDeadError
from mrv2.outputs import RequestOutputKind
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import SamplingParams

# Long enough that a 400-token request is still running when a test freezes the core.
ARGS = dict(max_model_len=512, max_num_seqs=8, device="cpu")
LONG = 400
PROMPTS = ["hello world", "def fibonacci(n):", "the quick brown fox", "import os"]
DELTA, CUMULATIVE, FINAL_ONLY = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                 RequestOutputKind.FINAL_ONLY)


def greedy(max_tokens=24, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def llm(tiny_llama, loop):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), **ARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def local(tiny_llama):
    return LLM(str(tiny_llama), **ARGS)


@contextmanager
def frozen(llm: AsyncLLM):
    """The core process stopped: what is sent to it waits in its socket."""
    os.kill(llm.engine_core.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(llm.engine_core.proc.pid, signal.SIGCONT)


async def last_output(llm, prompt, params, request_id, kind=CUMULATIVE):
    outputs = [out async for out in llm.generate(prompt, params, request_id, kind)]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs[-1]


async def idle_stats(llm, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await llm.get_stats()
        if not stats.has_unfinished or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


def summary(output):
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def test_concurrent_generate_equals_in_process(llm, loop, local):
    [base] = local.generate(PROMPTS[1], greedy(40), use_tqdm=False)
    text = base.outputs[0].text
    params = [greedy(), greedy(40, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
              greedy(16, n=3, temperature=0.9, seed=5), greedy(30)]
    want = local.generate(PROMPTS, params, use_tqdm=False)

    async def run():
        return await asyncio.gather(*[last_output(llm, p, sp, f"c{i}")
                                      for i, (p, sp) in enumerate(zip(PROMPTS, params))])

    got = loop.run_until_complete(run())
    assert [summary(g) for g in got] == [summary(w) for w in want]
    assert got[1].outputs[0].finish_reason == "stop"
    stats = loop.run_until_complete(idle_stats(llm))
    assert stats.num_running == 0 and stats.kv_cache_usage == 0


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_output_kinds(llm, loop):
    async def run():
        streams = {kind: [o async for o in llm.generate(PROMPTS[2], greedy(30), f"k{kind}", kind)]
                   for kind in (DELTA, CUMULATIVE, FINAL_ONLY)}
        return streams

    streams = loop.run_until_complete(run())
    final = streams[CUMULATIVE][-1].outputs[0]
    assert len(streams[FINAL_ONLY]) == 1 and summary(streams[FINAL_ONLY][0]) == [
        (0, final.token_ids, final.text, "length", None)]
    # DELTA outputs not yet taken are merged (as in vLLM), so a consumer slower than the
    # engine may get a single chunk; a run with several chunks proves they are deltas.
    delta_runs = [streams[DELTA]]
    while len(delta_runs[-1]) == 1 and len(delta_runs) < 5:
        delta_runs.append(loop.run_until_complete(_collect(
            llm.generate(PROMPTS[2], greedy(30), f"kd{len(delta_runs)}", DELTA))))
    assert len(delta_runs[-1]) > 1, "every DELTA stream arrived merged into one chunk"
    for deltas in delta_runs:
        assert "".join(o.outputs[0].text for o in deltas) == final.text
        assert [t for o in deltas for t in o.outputs[0].token_ids] == final.token_ids
    texts = [o.outputs[0].text for o in streams[CUMULATIVE]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_abort_mid_stream_frees_the_request(llm, loop):
    async def run():
        outputs = []
        generator = llm.generate(PROMPTS[0], greedy(LONG), "ab", CUMULATIVE)
        outputs.append(await anext(generator))
        with frozen(llm):
            await llm.abort("ab")
            async for out in generator:  # ends with the abort output
                outputs.append(out)
        return outputs, await idle_stats(llm)

    outputs, stats = loop.run_until_complete(run())
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < LONG
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert not llm.output_processor.has_unfinished_requests()
    # The id can be used again.
    again = loop.run_until_complete(last_output(llm, PROMPTS[0], greedy(4), "ab"))
    assert len(again.outputs[0].token_ids) == 4


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_leaving_generate_aborts_the_request(llm, loop, how):
    async def run():
        got_first = asyncio.Event()

        async def consume():
            async for out in llm.generate(PROMPTS[3], greedy(LONG, n=2, seed=1,
                                                             temperature=1.0), how):
                got_first.set()
                if how == "close":
                    break  # the async for closes the generator
                await asyncio.sleep(3600)

        task = loop.create_task(consume())
        await got_first.wait()
        with frozen(llm):
            if how == "cancel":  # e.g. the HTTP client went away
                task.cancel()
            with pytest.raises(asyncio.CancelledError) if how == "cancel" else nullcontext():
                await task
        return await idle_stats(llm)

    stats = loop.run_until_complete(run())
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert not llm.output_processor.has_unfinished_requests() and not llm._streams


class nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_requests_leave_the_engine_working(llm, loop):
    async def run():
        generator = llm.generate(PROMPTS[0], greedy(LONG), "dup")
        await anext(generator)
        with pytest.raises(ValueError, match="already in use"):
            await anext(llm.generate(PROMPTS[1], greedy(), "dup"))
        with pytest.raises(PromptError):
            await anext(llm.generate("", greedy(), "empty"))
        # A request the core itself refuses (here: an id it already runs) fails its stream.
        await llm.engine_core.add_request_async(EngineCoreRequest(
            request_id="dup", prompt_token_ids=[5], sampling_params=greedy(),
            eos_token_id=1, arrival_time=0.0))
        with pytest.raises(RequestRejectedError, match="already queued"):
            async for _ in generator:
                pass
        return await idle_stats(llm)

    stats = loop.run_until_complete(run())
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert loop.run_until_complete(llm.engine_core.call_utility_async("echo", 7)) == [7]
    assert llm.is_running and not llm.errored


def test_reset_prefix_cache(llm, loop):
    """Refused while a request holds blocks, done once it finished (vLLM's AsyncLLM method)."""
    async def run():
        generator = llm.generate(PROMPTS[0], greedy(LONG), "holding")
        await anext(generator)
        refused = await llm.reset_prefix_cache()
        await llm.abort("holding")
        await generator.aclose()
        await idle_stats(llm)
        return refused, await llm.reset_prefix_cache()

    assert loop.run_until_complete(run()) == (False, True)


def test_sleep_and_wake_up_through_the_core_process(llm, loop):
    async def run():
        expected = [o async for o in llm.generate(PROMPTS[1], greedy(), "before")][-1]
        await llm.sleep(2)
        asleep = await llm.is_sleeping()
        with pytest.raises(Exception, match="asleep"):
            async for _ in llm.generate(PROMPTS[1], greedy(), "while asleep"):
                pass
        with pytest.raises(Exception, match="tags"):
            await llm.wake_up(["weights"])
        await llm.wake_up()
        after = [o async for o in llm.generate(PROMPTS[1], greedy(), "after")][-1]
        return asleep, await llm.is_sleeping(), expected, after

    asleep, still, expected, after = loop.run_until_complete(run())
    assert asleep and not still
    assert after.outputs[0].token_ids == expected.outputs[0].token_ids

def test_shutdown_ends_streams_and_the_process(llm, loop):
    # Last test on the module's engine: it shuts it down.
    proc, ipc_dir = llm.engine_core.proc, llm.engine_core.ipc_dir

    async def consume():
        async for _ in llm.generate(PROMPTS[0], greedy(LONG), "sd"):
            pass

    async def run():
        with frozen(llm):  # the request waits in the core's socket
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
        llm.shutdown()  # no await since the core resumed: no output reached the stream
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        with pytest.raises(EngineDeadError):
            await anext(llm.generate(PROMPTS[0], greedy(), "after"))

    loop.run_until_complete(run())
    llm.shutdown()  # idempotent
    assert proc.exitcode == 0 and not os.path.exists(ipc_dir) and not mp.active_children()
    assert llm.errored and not llm.is_running


def test_killed_core_fails_every_generate(tiny_llama):
    async def run():
        llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), **ARGS))
        pid = llm.engine_core.proc.pid
        started = asyncio.Semaphore(0)

        async def consume(i):
            async for _ in llm.generate(PROMPTS[i], greedy(LONG), f"k{i}"):
                started.release()
            return "finished"

        tasks = [asyncio.create_task(consume(i)) for i in range(len(PROMPTS))]
        stats_call = None
        for _ in PROMPTS:
            await started.acquire()
        os.kill(pid, signal.SIGSTOP)  # keep every request unfinished
        stats_call = asyncio.create_task(llm.get_stats())
        await asyncio.sleep(0.2)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, stats_call, return_exceptions=True), 10)
        elapsed = time.monotonic() - killed
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < 5
        assert llm.errored and not llm.is_running
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died unexpectedly"):
            await anext(llm.generate(PROMPTS[0], greedy(), "late"))
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        assert time.monotonic() - start < 1
        llm.shutdown()
        llm.shutdown()
        return llm.engine_core

    client = asyncio.run(run())
    assert client.proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(client.ipc_dir) and not mp.active_children()


def test_merged_deltas_concatenate_logprobs():
    from mrv2.engine.async_llm import _merge_delta
    from mrv2.outputs import CompletionOutput, RequestOutput

    def delta(ids, logprobs, prompt_logprobs=None, finish=None):
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                             outputs=[CompletionOutput(index=0, text="x" * len(ids),
                                                       token_ids=ids, logprobs=logprobs,
                                                       cumulative_logprob=-float(len(ids)),
                                                       finish_reason=finish)],
                             finished=finish is not None, prompt_logprobs=prompt_logprobs)

    merged = _merge_delta(delta([5], [{5: -0.1}], prompt_logprobs=[None]),
                          delta([6, 7], [{6: -0.2}, {7: -0.3}], finish="length"))
    [completion] = merged.outputs
    assert completion.token_ids == [5, 6, 7] and completion.text == "xxx"
    assert completion.logprobs == [{5: -0.1}, {6: -0.2}, {7: -0.3}]
    assert completion.cumulative_logprob == -2.0 and completion.finish_reason == "length"
    assert merged.prompt_logprobs == [None] and merged.finished
    plain = _merge_delta(delta([5], None), delta([6], None))
    assert plain.outputs[0].logprobs is None

