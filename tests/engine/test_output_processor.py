"""OutputProcessor: RequestOutputs per output kind, stop strings, n > 1 gathering, aborts."""

from __future__ import annotations

import random

import pytest

from mrv2.engine.output_processor import OutputProcessor, child_request_id
from mrv2.outputs import RequestOutput, RequestOutputKind
from mrv2.protocol import EngineCoreOutput, FinishReason
from mrv2.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
FINAL, CUMULATIVE, DELTA = (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE,
                            RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def out(req_id: str, *tokens: int, reason: FinishReason | None = None,
        stop_reason: int | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=req_id, new_token_ids=list(tokens), finish_reason=reason,
                            stop_reason=stop_reason)


def step(proc: OutputProcessor, *outs: EngineCoreOutput) -> list[RequestOutput]:
    result = proc.process_outputs(list(outs))
    assert result.reqs_to_abort == []
    return result.request_outputs


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_final_only_emits_once_at_the_end(tokenizer):
    proc = OutputProcessor(tokenizer)
    assert proc.add_request("a", "the prompt", [0, 10, 11], SamplingParams()) == ["a"]
    assert proc.num_unfinished == 1 and proc.has_unfinished_requests()
    assert step(proc, out("a", 50)) == []
    assert step(proc, out("a", 60)) == []
    [result] = step(proc, out("a", 70, reason=FinishReason.LENGTH))
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
    proc.add_request("a", None, [5], SamplingParams(), CUMULATIVE)
    results = [step(proc, out("a", 50)), step(proc, out("a", 60)),
               step(proc, out("a", 70, reason=FinishReason.LENGTH))]
    assert [len(r) for r in results] == [1, 1, 1]
    outputs = [r[0] for r in results]
    assert [o.outputs[0].token_ids for o in outputs] == [[50], [50, 60], [50, 60, 70]]
    assert [o.finished for o in outputs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]
    assert outputs[1].outputs[0].text == tokenizer.decode([50, 60])
    # Each output owns its token list: later steps do not mutate earlier outputs.
    assert outputs[0].outputs[0].token_ids == [50]


def test_delta_emits_only_the_new_part(tokenizer):
    ids = encode(tokenizer, "hello 你好 world")
    proc = OutputProcessor(tokenizer)
    proc.add_request("d", None, [5], SamplingParams(), DELTA)
    outputs = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        [o] = step(proc, out("d", t, reason=FinishReason.LENGTH if last else None))
        outputs.append(o.outputs[0])
    assert [c.token_ids for c in outputs] == [[t] for t in ids]
    assert "".join(c.text for c in outputs) == "hello 你好 world"
    assert all(REPLACEMENT not in c.text for c in outputs)
    assert [c.finish_reason for c in outputs] == [None] * (len(ids) - 1) + ["length"]


@pytest.mark.parametrize("reason, text", [(FinishReason.STOP, "stop"),
                                          (FinishReason.LENGTH, "length"),
                                          (FinishReason.ABORT, "abort")])
def test_finish_reason_strings(tokenizer, reason, text):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams())
    [result] = step(proc, out("a", 9, reason=reason))
    assert result.outputs[0].finish_reason == text
    assert result.outputs[0].finished()


def test_stop_reason_is_the_stop_token(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("s", None, [5], SamplingParams(stop_token_ids=[42]))
    proc.add_request("e", None, [5], SamplingParams())
    results = step(proc, out("s", 7, 42, reason=FinishReason.STOP, stop_reason=42),
                   out("e", 1, reason=FinishReason.STOP))
    by_id = {r.request_id: r.outputs[0] for r in results}
    assert by_id["s"].stop_reason == 42 and by_id["s"].token_ids == [7, 42]
    # The stop token's text is not part of the output (vLLM), its id is.
    assert by_id["s"].text == tokenizer.decode([7])
    assert by_id["e"].stop_reason is None and by_id["e"].finish_reason == "stop"


def test_stop_string_finishes_and_asks_for_a_core_abort(tokenizer):
    ids = encode(tokenizer, "one two three four")
    proc = OutputProcessor(tokenizer)
    proc.add_request("s", None, [5], SamplingParams(stop=["thr"]), CUMULATIVE)
    proc.add_request("t", None, [5], SamplingParams(stop=["four"]))
    results, aborts = [], []
    for t in ids:
        r = proc.process_outputs([out("s", t), out("t", t)])
        results += r.request_outputs
        aborts += r.reqs_to_abort
    # "s" stopped on its own; "t" stopped on the last token (the core has not finished it).
    assert aborts == ["s", "t"]
    final = {r.request_id: r for r in results if r.finished}
    assert final["s"].outputs[0].text == "one two "
    assert final["s"].outputs[0].finish_reason == "stop"
    assert final["s"].outputs[0].stop_reason == "thr"
    assert final["t"].outputs[0].text == "one two three "
    assert final["t"].outputs[0].token_ids == ids
    assert not proc.has_unfinished_requests()
    # Outputs the core produced before the abort reached it are dropped.
    assert proc.process_outputs([out("s", 9)]).request_outputs == []


def test_stop_string_when_the_core_finished_too(tokenizer):
    ids = encode(tokenizer, "abc xyz")
    proc = OutputProcessor(tokenizer)
    proc.add_request("s", None, [5], SamplingParams(stop=["xyz"]))
    result = proc.process_outputs([out("s", *ids, reason=FinishReason.LENGTH)])
    assert result.reqs_to_abort == []  # the core already freed it
    [completion] = result.request_outputs[0].outputs
    assert completion.text == "abc " and completion.finish_reason == "stop"
    assert completion.stop_reason == "xyz"


def test_aborted_and_unknown_ids_ignored(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams(), CUMULATIVE)
    proc.add_request("b", None, [5], SamplingParams(), CUMULATIVE)
    assert proc.abort_requests(["a", "never-added"]) == ["a", "never-added"]
    assert proc.num_unfinished == 1
    results = step(proc, out("a", 9), out("zzz", 3, reason=FinishReason.LENGTH), out("b", 8))
    assert [r.request_id for r in results] == ["b"]
    proc.abort_requests(["a"])  # twice is fine
    assert proc.num_unfinished == 1


def test_duplicate_request_id_refused(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [5], SamplingParams())
    with pytest.raises(ValueError, match="'a'"):
        proc.add_request("a", None, [6], SamplingParams())
    # Once finished, the id is free again.
    step(proc, out("a", 9, reason=FinishReason.LENGTH))
    proc.add_request("a", None, [6], SamplingParams())


def test_outputs_in_input_order(tokenizer):
    proc = OutputProcessor(tokenizer)
    for r in ("x", "y", "z"):
        proc.add_request(r, None, [5], SamplingParams())
    results = step(proc, out("z", 1, reason=FinishReason.STOP), out("x", 2),
                   out("y", 3, reason=FinishReason.LENGTH))
    assert [r.request_id for r in results] == ["z", "y"]


@pytest.mark.parametrize("kind", [FINAL, CUMULATIVE, DELTA])
def test_multibyte_char_split_across_tokens(tokenizer, kind):
    text = "你好🙂"
    ids = encode(tokenizer, text)
    first_char = encode(tokenizer, text[0])
    # The test means something only if the character really is split into byte tokens.
    assert len(first_char) > 1 and ids[:len(first_char)] == first_char
    assert all(tokenizer.decode([t]) == REPLACEMENT for t in first_char)

    proc = OutputProcessor(tokenizer)
    proc.add_request("u", None, [5], SamplingParams(), kind)
    results = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        results += step(proc, out("u", token, reason=FinishReason.LENGTH if last else None))
    texts = [r.outputs[0].text for r in results]
    assert all(REPLACEMENT not in t for t in texts)
    if kind == FINAL:
        assert texts == [text]
    elif kind == CUMULATIVE:
        assert texts[-1] == text and len(texts) == len(ids)
        # Once a character's last byte arrived, it is whole in the cumulative text.
        assert texts[len(first_char) - 2] == "" and texts[len(first_char) - 1] == text[0]
    else:
        assert "".join(texts) == text


def test_skip_special_tokens(tokenizer):
    im_start, im_end, eos = 3, 4, tokenizer.eos_token_id
    body = encode(tokenizer, "hi")
    proc = OutputProcessor(tokenizer)
    proc.add_request("skip", None, [5], SamplingParams())
    proc.add_request("keep", None, [5], SamplingParams(skip_special_tokens=False))
    results = step(proc, out("skip", im_start, *body, im_end, eos, reason=FinishReason.STOP),
                   out("keep", im_start, *body, im_end, eos, reason=FinishReason.STOP))
    by_id = {r.request_id: r.outputs[0].text for r in results}
    assert by_id["skip"] == "hi"
    # Special tokens show; the EOS that stopped the request does not (vLLM).
    assert by_id["keep"] == "<|im_start|>hi<|im_end|>"


def test_no_tokenizer_gives_empty_text():
    proc = OutputProcessor(None)
    proc.add_request("a", None, [5], SamplingParams(), DELTA)
    [result] = step(proc, out("a", 9, 10, reason=FinishReason.LENGTH))
    assert result.outputs[0].text == "" and result.outputs[0].token_ids == [9, 10]


# -- n > 1 -------------------------------------------------------------------------------

def add_parent(proc, kind, n=3, request_id="p", **params) -> list[str]:
    sp = SamplingParams(n=n, **params)
    return proc.add_request(request_id, "prompt", [5, 6], sp, kind,
                            child_params=[sp.clone(n=1)] * n)


def test_parent_final_only_gathers_all_children(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = add_parent(proc, FINAL)
    assert ids == ["0_p", "1_p", "2_p"] == [child_request_id("p", i) for i in range(3)]
    assert step(proc, out("1_p", 11, reason=FinishReason.LENGTH), out("0_p", 10)) == []
    assert step(proc, out("2_p", 12, reason=FinishReason.STOP), out("0_p", 20)) == []
    [result] = step(proc, out("0_p", 30, reason=FinishReason.LENGTH))
    assert result.request_id == "p" and result.finished and result.prompt == "prompt"
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert [c.token_ids for c in result.outputs] == [[10, 20, 30], [11], [12]]
    assert [c.finish_reason for c in result.outputs] == ["length", "length", "stop"]
    assert not proc.has_unfinished_requests() and not proc.parents


def test_parent_cumulative_and_delta(tokenizer):
    proc = OutputProcessor(tokenizer)
    add_parent(proc, CUMULATIVE, n=2)
    [r1] = step(proc, out("1_p", 11))
    assert [c.token_ids for c in r1.outputs] == [[], [11]] and not r1.finished
    [r2] = step(proc, out("0_p", 10), out("1_p", 21, reason=FinishReason.LENGTH))
    assert [c.token_ids for c in r2.outputs] == [[10], [11, 21]] and not r2.finished
    [r3] = step(proc, out("0_p", 20, reason=FinishReason.LENGTH))
    assert [c.token_ids for c in r3.outputs] == [[10, 20], [11, 21]] and r3.finished

    proc = OutputProcessor(tokenizer)
    add_parent(proc, DELTA, n=2)
    [r1] = step(proc, out("1_p", 11), out("0_p", 10))
    assert [(c.index, c.token_ids) for c in r1.outputs] == [(0, [10]), (1, [11])]
    [r2] = step(proc, out("1_p", 21, reason=FinishReason.LENGTH))
    assert [(c.index, c.token_ids) for c in r2.outputs] == [(1, [21])] and not r2.finished
    [r3] = step(proc, out("0_p", 20, reason=FinishReason.LENGTH))
    assert [(c.index, c.token_ids) for c in r3.outputs] == [(0, [20])] and r3.finished


def test_parent_abort_and_child_stop_string(tokenizer):
    proc = OutputProcessor(tokenizer)
    add_parent(proc, FINAL, n=2, stop=["ab"])
    ab = encode(tokenizer, "xab")
    result = proc.process_outputs([out("0_p", *ab)])
    assert result.reqs_to_abort == ["0_p"] and result.request_outputs == []
    assert proc.abort_requests(["p"]) == ["1_p"]  # only the child still running
    assert not proc.has_unfinished_requests() and not proc.parents
    assert proc.process_outputs([out("1_p", 5)]).request_outputs == []


def test_parent_and_child_ids_must_be_free(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("1_p", None, [5], SamplingParams())
    with pytest.raises(ValueError, match="'1_p'"):
        add_parent(proc, FINAL)
    assert proc.num_unfinished == 1 and not proc.parents
    add_parent(proc, FINAL, request_id="q")
    with pytest.raises(ValueError, match="'q'"):
        proc.add_request("q", None, [5], SamplingParams())


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_streaming_random_ids_with_stop_strings(tokenizer, kind):
    """Streamed text always grows to the final text and never shows a stop string."""
    rng = random.Random(3)
    for trial in range(40):
        ids = [rng.randrange(5, 2048) for _ in range(rng.randrange(2, 30))]
        full = tokenizer.decode(ids)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randrange(1, 4)] if trial % 4 else "\x00never"
        proc = OutputProcessor(tokenizer)
        proc.add_request("r", None, [5], SamplingParams(stop=[stop]), kind)
        shown = []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            for r in proc.process_outputs(
                    [out("r", t, reason=FinishReason.LENGTH if last else None)]).request_outputs:
                shown.append(r.outputs[0])
        final_text = "".join(c.text for c in shown) if kind == DELTA else shown[-1].text
        assert shown[-1].finish_reason is not None
        if shown[-1].stop_reason is not None:
            assert final_text == full[:full.index(stop)]
        else:
            assert final_text == full and stop not in full
        so_far = ""
        for c in shown:
            so_far = so_far + c.text if kind == DELTA else c.text
            assert final_text.startswith(so_far) and stop not in so_far


def test_a_pooling_request_gives_one_pooling_output_when_it_finishes(tokenizer):
    import numpy as np
    import torch

    from mrv2.outputs import PoolingRequestOutput
    from mrv2.pooling_params import PoolingParams, engine_sampling_params

    proc = OutputProcessor(tokenizer)
    vector = np.array([3.0, 4.0], dtype=np.float32).tobytes()
    for req_id, normalize in (("n", True), ("raw", False), ("failed", True)):
        proc.add_request(req_id, None, [0, 7], engine_sampling_params(), FINAL,
                         pooling=PoolingParams(normalize=normalize, task="embed"))
    results = step(proc, EngineCoreOutput("n", [9], FinishReason.LENGTH, pooled=vector),
                   EngineCoreOutput("raw", [9], FinishReason.STOP, pooled=vector),
                   out("failed", reason=FinishReason.ERROR))
    assert [type(r) for r in results] == [PoolingRequestOutput] * 3
    assert [r.request_id for r in results] == ["n", "raw", "failed"]
    assert results[0].outputs.data.tolist() == pytest.approx([0.6, 0.8])
    assert torch.equal(results[1].outputs.data, torch.tensor([3.0, 4.0]))
    assert results[2].outputs.data is None  # the engine failed it: no vector
    assert results[0].prompt_token_ids == [0, 7] and results[0].finished
    assert not proc.has_unfinished_requests()
