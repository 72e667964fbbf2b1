"""OutputProcessor: token accumulation, RequestOutput building, and whole-output decoding."""

from __future__ import annotations

import pytest

from mrv2.engine.output import OutputProcessor
from mrv2.outputs import RequestOutput
from mrv2.protocol import EngineCoreOutput, FinishReason
from mrv2.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def out(req_id: str, *tokens: int, reason: FinishReason | None = None,
        stop_reason: int | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=req_id, new_token_ids=list(tokens), finish_reason=reason,
                            stop_reason=stop_reason)


def test_final_only_emits_once_at_the_end(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", "the prompt", [0, 10, 11], SamplingParams(), final_only=True)
    assert proc.num_unfinished == 1
    assert proc.process_outputs([out("a", 50)]) == []
    assert proc.process_outputs([out("a", 60)]) == []
    [result] = proc.process_outputs([out("a", 70, reason=FinishReason.LENGTH)])
    assert isinstance(result, RequestOutput)
    assert result.request_id == "a" and result.finished
    assert result.prompt == "the prompt" and result.prompt_token_ids == [0, 10, 11]
    [completion] = result.outputs
    assert completion.index == 0
    assert completion.token_ids == [50, 60, 70]
    assert completion.text == tokenizer.decode([50, 60, 70], skip_special_tokens=True)
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert proc.num_unfinished == 0


def test_cumulative_emits_every_step(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams(), final_only=False)
    results = [proc.process_outputs([out("a", 50)]), proc.process_outputs([out("a", 60)]),
               proc.process_outputs([out("a", 70, reason=FinishReason.LENGTH)])]
    assert [len(r) for r in results] == [1, 1, 1]
    outputs = [r[0] for r in results]
    assert [o.outputs[0].token_ids for o in outputs] == [[50], [50, 60], [50, 60, 70]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[1].outputs[0].text == tokenizer.decode([50, 60])
    # Each output owns its token list: later steps do not mutate earlier outputs.
    assert outputs[0].outputs[0].token_ids == [50]


@pytest.mark.parametrize("reason, text", [(FinishReason.STOP, "stop"),
                                          (FinishReason.LENGTH, "length"),
                                          (FinishReason.ABORT, "abort")])
def test_finish_reason_strings(tokenizer, reason, text):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams())
    [result] = proc.process_outputs([out("a", 9, reason=reason)])
    assert result.outputs[0].finish_reason == text
    assert result.outputs[0].finished()


def test_stop_reason_is_the_stop_token(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("s", None, [5], SamplingParams(stop_token_ids=[42]))
    proc.add_request("e", None, [5], SamplingParams())
    results = proc.process_outputs([out("s", 7, 42, reason=FinishReason.STOP, stop_reason=42),
                                    out("e", 1, reason=FinishReason.STOP)])
    by_id = {r.request_id: r.outputs[0] for r in results}
    assert by_id["s"].stop_reason == 42 and by_id["s"].token_ids == [7, 42]
    assert by_id["e"].stop_reason is None and by_id["e"].finish_reason == "stop"


def test_aborted_and_unknown_ids_ignored(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams(), final_only=False)
    proc.add_request("b", None, [5], SamplingParams(), final_only=False)
    proc.abort_requests(["a", "never-added"])
    assert proc.num_unfinished == 1
    results = proc.process_outputs([out("a", 9), out("zzz", 3, reason=FinishReason.LENGTH),
                                    out("b", 8)])
    assert [r.request_id for r in results] == ["b"]
    proc.abort_requests(["a"])  # twice is fine
    assert proc.num_unfinished == 1


def test_duplicate_request_id_refused(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams())
    with pytest.raises(ValueError, match="'a'"):
        proc.add_request("a", None, [6], SamplingParams())
    # Once finished, the id is free again.
    proc.process_outputs([out("a", 9, reason=FinishReason.LENGTH)])
    proc.add_request("a", None, [6], SamplingParams())


def test_outputs_in_input_order(tokenizer):
    proc = OutputProcessor(tokenizer)
    for r in ("x", "y", "z"):
        proc.add_request(r, None, [5], SamplingParams())
    results = proc.process_outputs([out("z", 1, reason=FinishReason.STOP), out("x", 2),
                                    out("y", 3, reason=FinishReason.LENGTH)])
    assert [r.request_id for r in results] == ["z", "y"]


def test_multibyte_char_split_across_tokens_decodes_whole(tokenizer):
    text = "你好🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_char = tokenizer.encode(text[0], add_special_tokens=False)
    # The test means something only if the character really is split into byte tokens.
    assert len(first_char) > 1 and ids[:len(first_char)] == first_char
    assert all(tokenizer.decode([t]) == REPLACEMENT for t in first_char)
    assert tokenizer.decode(first_char) == text[0]

    for final_only in (True, False):
        proc = OutputProcessor(tokenizer)
        proc.add_request("u", None, [5], SamplingParams(), final_only=final_only)
        results = []
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            results += proc.process_outputs(
                [out("u", token, reason=FinishReason.LENGTH if last else None)])
        final = results[-1].outputs[0]
        assert final.text == text and final.token_ids == ids
        assert REPLACEMENT not in final.text
        if not final_only:
            assert len(results) == len(ids)
            # Once a character's last byte arrived, it is whole in the cumulative text.
            assert results[len(first_char) - 1].outputs[0].text == text[0]


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    proc = OutputProcessor(tokenizer)
    proc.add_request("skip", None, [5], SamplingParams())
    proc.add_request("keep", None, [5], SamplingParams(skip_special_tokens=False))
    body = tokenizer.encode("hi", add_special_tokens=False)
    results = proc.process_outputs([out("skip", *body, eos, reason=FinishReason.STOP),
                                    out("keep", *body, eos, reason=FinishReason.STOP)])
    by_id = {r.request_id: r.outputs[0].text for r in results}
    assert by_id["skip"] == "hi"
    assert by_id["keep"] == "hi" + tokenizer.eos_token


def test_no_tokenizer_gives_empty_text():
    proc = OutputProcessor(None)
    proc.add_request("a", None, [5], SamplingParams())
    [result] = proc.process_outputs([out("a", 9, 10, reason=FinishReason.LENGTH)])
    assert result.outputs[0].text == "" and result.outputs[0].token_ids == [9, 10]
