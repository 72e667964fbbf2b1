"""InputBatch sizes that only tests read, from the views the step runs on."""

from __future__ import annotations

from mrv2.inputs.batch import InputBatch


def num_reqs(batch: InputBatch) -> int:
    """Real rows of the step."""
    return len(batch.req_ids)


def num_tokens_padded(batch: InputBatch) -> int:
    """Tokens the step is padded to (DESIGN.md invariant 6): input_ids spans them all."""
    return batch.input_ids.shape[0]


def num_reqs_padded(batch: InputBatch) -> int:
    """Rows the step is padded to: the attention metadata has one seq_len per padded row."""
    return batch.attn_metadata.seq_lens.shape[0]
