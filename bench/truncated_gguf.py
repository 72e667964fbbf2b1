"""A draft model for speculative-decoding benchmarks made from a GGUF file: its first N layers
with its own embedding, final norm and LM head (the file's blocks as stored). It shares the
tokenizer and, untrained as a draft, agrees with the full model where the later layers change
little (LayerSkip's early exit, here without its training).

    PYTHONPATH=. python bench/truncated_gguf.py SRC.gguf DST.gguf NUM_LAYERS
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf

_BLOCK = re.compile(r"blk\.(\d+)\.")


def truncate_gguf(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write `dst`: `src` with only its blocks 0 .. num_layers - 1 and block_count set."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if not 0 < num_layers <= reader.fields[block_count].contents():
        raise ValueError(f"{src}: cannot keep {num_layers} of "
                         f"{reader.fields[block_count].contents()} layers")
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    alignment = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        kind = field.types[0]
        value = num_layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    kept = [t for t in reader.tensors
            if (m := _BLOCK.match(t.name)) is None or int(m.group(1)) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst)


if __name__ == "__main__":
    truncate_gguf(sys.argv[1], sys.argv[2], int(sys.argv[3]))
