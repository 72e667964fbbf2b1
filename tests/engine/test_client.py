"""Engine-core clients: InprocClient, and MPClient under LLM(multiprocess_core=True).

One core process serves the module; the last test kills it. Start-up failure has its own.
(AsyncMPClient is exercised through AsyncLLM in test_async_llm.py.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import threading
import time

import pytest

from mrv2 import LLM
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.client import InprocClient, MPClient, RequestRejectedError
from mrv2.errors import EngineDeadError, WorkerError, WorkerStartupError
from mrv2.outputs import RequestOutputKind
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import SamplingParams

ARGS = dict(max_model_len=128, max_num_seqs=8, device="cpu")
PROMPTS = ["hello world", "def fibonacci(n):", "the quick brown fox", "import os"]


def greedy(max_tokens=24, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def core_request(request_id: str, max_tokens: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[5, 17, 300],
                             sampling_params=greedy(max_tokens), eos_token_id=1,
                             arrival_time=0.0)


def wait_idle(client, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get_stats()
        if not stats.has_unfinished or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.fixture(scope="module")
def local(tiny_llama):
    return LLM(str(tiny_llama), **ARGS)


@pytest.fixture(scope="module")
def remote(tiny_llama):
    llm = LLM(str(tiny_llama), multiprocess_core=True, **ARGS)
    yield llm
    llm.shutdown()


def summary(outputs):
    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def test_inproc_client(tiny_llama):
    client = InprocClient(EngineArgs(model=str(tiny_llama), **ARGS).create_engine_config())
    client.add_request(core_request("a", max_tokens=4))
    with pytest.raises(ValueError, match="already queued"):
        client.add_request(core_request("a"))  # refused at once, in process
    tokens = []
    while client.get_stats().has_unfinished:
        tokens += [t for o in client.get_output().outputs for t in o.new_token_ids]
    assert len(tokens) == 4
    client.add_request(core_request("b", max_tokens=50))
    client.get_output()
    client.abort_requests(["b"])
    stats = client.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert client.call_utility("echo", 1, "x") == [1, "x"]
    with pytest.raises(AttributeError, match="nope"):
        client.call_utility("nope")
    client.shutdown()


def test_outputs_equal_in_process(local, remote):
    assert isinstance(remote.llm_engine.core_client, MPClient)
    assert remote.llm_engine.engine_core is None
    params = [greedy(), greedy(max_tokens=40), greedy(n=2, temperature=0.8, seed=3),
              SamplingParams(temperature=1.0, seed=7, max_tokens=16)]
    want = local.generate(PROMPTS, params, use_tqdm=False)
    got = remote.generate(PROMPTS, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert all(len(c.token_ids) > 0 for o in got for c in o.outputs)


def test_stop_string_and_streaming(local, remote):
    [base] = local.generate(PROMPTS[1], greedy(40), use_tqdm=False)
    text = base.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = greedy(40, stop=[stop])
    [want] = local.generate(PROMPTS[1], params, use_tqdm=False)
    engine = remote.llm_engine
    engine.add_request("s", PROMPTS[1], params, RequestOutputKind.DELTA)
    shown, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            shown += out.outputs[0].text
            last = out
    assert shown == want.outputs[0].text and last.outputs[0].stop_reason == stop
    # The core aborted the stopped request: nothing is left running there.
    stats = wait_idle(engine.core_client)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0


def test_abort_frees_the_request(remote):
    engine = remote.llm_engine
    engine.add_request("long", {"prompt_token_ids": [5, 6, 7]}, greedy(100))
    engine.step()
    engine.abort_request("long")
    assert not engine.has_unfinished_requests() and engine.step() == []
    stats = wait_idle(engine.core_client)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0 and not stats.has_unfinished


def test_refused_request_raises_from_get_output(remote):
    client = remote.llm_engine.core_client
    client.add_request(core_request("dup", max_tokens=30))
    client.add_request(core_request("dup"))
    tokens, rejected = 0, None
    while True:
        try:
            outputs = client.get_output(timeout=5)
        except RequestRejectedError as error:
            rejected = error
            continue
        assert outputs.outputs, "timed out"
        # (Outputs the previous test's aborted request made before its abort may come too.)
        mine = [o for o in outputs.outputs if o.request_id == "dup"]
        tokens += sum(len(o.new_token_ids) for o in mine)
        if any(o.finished for o in mine):
            break
    assert rejected.request_id == "dup" and "already queued" in str(rejected)
    assert isinstance(rejected, ValueError) and tokens == 30


def test_utilities_and_timeout(remote):
    client = remote.llm_engine.core_client
    assert client.call_utility("echo", [1, 2], {"a": 3}) == [[1, 2], {"a": 3}]
    with pytest.raises(WorkerError, match="no_such_utility") as info:
        client.call_utility("no_such_utility")
    assert info.value.exc_type == "AttributeError" and "Traceback" in info.value.remote_traceback
    start = time.monotonic()
    assert client.get_output(timeout=0.05).outputs == []
    assert time.monotonic() - start < 1
    assert client.get_stats().num_kv_blocks == client.ready.num_kv_blocks


def test_killed_core_fails_every_waiting_caller(remote):
    # Last test on the module's core: it kills it.
    client = remote.llm_engine.core_client
    pid = client.proc.pid
    client.add_request(core_request("w1", max_tokens=100))
    client.add_request(core_request("w2", max_tokens=100))
    client.get_output(timeout=5)
    os.kill(pid, signal.SIGSTOP)  # requests stay unfinished; the utility call stays unanswered
    errors: dict[str, tuple[BaseException, float]] = {}

    def wait(name, call):
        try:
            while True:
                call()
        except BaseException as error:
            errors[name] = (error, time.monotonic())

    threads = [threading.Thread(target=wait, args=("get_output_1", client.get_output)),
               threading.Thread(target=wait, args=("get_output_2", client.get_output)),
               threading.Thread(target=wait, args=("utility", lambda: client.call_utility("echo"))),
               threading.Thread(target=wait, args=("generate", lambda: remote.generate(
                   PROMPTS, greedy(100), use_tqdm=False)))]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(10)
    assert sorted(errors) == ["generate", "get_output_1", "get_output_2", "utility"]
    for name, (error, when) in errors.items():
        assert isinstance(error, EngineDeadError), (name, error)
        assert when - killed < 5, name
    assert "died unexpectedly" in str(errors["utility"][0])
    # Later calls fail at once.
    start = time.monotonic()
    for call in (lambda: client.add_request(core_request("late")), client.get_output,
                 lambda: client.abort_requests(["w1"]), client.get_stats,
                 lambda: remote.generate("hi", greedy(), use_tqdm=False)):
        with pytest.raises(EngineDeadError):
            call()
    assert time.monotonic() - start < 1
    remote.shutdown()
    remote.shutdown()  # idempotent
    assert client.proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(client.ipc_dir) and not mp.active_children()


def test_startup_failure_raises_the_core_error(tiny_llama, tmp_path, monkeypatch):
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    made = []
    real_mkdtemp = __import__("tempfile").mkdtemp
    monkeypatch.setattr("mrv2.engine.client.tempfile.mkdtemp",
                        lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    with pytest.raises(WorkerStartupError, match="failed to start") as info:
        LLM(str(bad), multiprocess_core=True, **ARGS)
    error = info.value
    assert "Traceback" in error.remote_traceback and "safetensors" in str(error).lower()
    assert error.exc_type
    assert made and not any(os.path.exists(d) for d in made)
    assert not mp.active_children()
