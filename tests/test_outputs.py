"""RequestOutput / CompletionOutput: vLLM's field names and defaults."""

from __future__ import annotations

from mrv2.outputs import CompletionOutput, RequestOutput


def test_completion_output_finished():
    running = CompletionOutput(index=0, text="ab", token_ids=[1, 2])
    assert not running.finished()
    assert running.finish_reason is None and running.stop_reason is None
    assert running.cumulative_logprob is None and running.logprobs is None
    for reason in ("stop", "length", "abort"):
        assert CompletionOutput(index=0, text="", token_ids=[], finish_reason=reason).finished()


def test_request_output_defaults_are_not_shared():
    completion = CompletionOutput(index=0, text="x", token_ids=[7], finish_reason="length")
    a = RequestOutput(request_id="a", prompt="p", prompt_token_ids=[1], outputs=[completion],
                      finished=True)
    b = RequestOutput(request_id="b", prompt=None, prompt_token_ids=[2], outputs=[],
                      finished=False)
    assert a.prompt_logprobs is None
    a.metrics["t"] = 1.0
    assert b.metrics == {}
    assert a.outputs[0].token_ids == [7] and a.finished and not b.finished


def test_request_output_kind_values_match_vllm():
    from mrv2.outputs import RequestOutputKind

    assert [(k.name, int(k)) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]
