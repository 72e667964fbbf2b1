"""mrv2.models.gguf.reader: the same metadata values, tensor types, dimensions and data as
`gguf.GGUFReader` (every value type, both byte orders, the tensor types mrv2 loads), plain
read-only views of the file, and a clear error for each kind of broken file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mrv2.models.gguf.reader import read_gguf_file

# Every type the test writer makes (K-quants come only from llama.cpp's quantizer: their data
# is read the same way, as rows of block bytes).
TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def reference(path) -> tuple[dict, list]:
    """GGUFReader's metadata values (its own GGUF.* entries left out) and tensors."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, reader.tensors


def assert_same_as_gguf_reader(path) -> None:
    fields, tensors = reference(path)
    ours = read_gguf_file(path)
    assert ours.fields == fields
    assert [type(v) for v in ours.fields.values()] == [type(v) for v in fields.values()]
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.dims == tuple(theirs.shape.tolist())
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert np.array_equal(mine.data, theirs.data, equal_nan=True), mine.name
        assert type(mine.data) is np.ndarray and not mine.data.flags.writeable


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_model_files_read_as_gguf_reader_reads_them(tiny_gguf_factory, tensor_type):
    assert_same_as_gguf_reader(tiny_gguf_factory("llama", tensor_type))


def write_every_value_type(path, endianess=gguf.GGUFEndian.LITTLE) -> None:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    for i, (name, value) in enumerate([("u8", 200), ("i8", -100), ("u16", 60000),
                                       ("i16", -30000), ("u32", 4_000_000_000),
                                       ("i32", -2_000_000_000), ("u64", 2**63 + 5),
                                       ("i64", -(2**62)), ("float32", 1.5),
                                       ("float64", -2.25)]):
        getattr(writer, f"add_{'uint' if name[0] == 'u' else 'int' if name[0] == 'i' else ''}"
                        f"{name[1:] if name[0] in 'ui' else name}")(f"t.{i}.{name}", value)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü" * 40])
    writer.add_array("t.bools", [True, False, True])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("h", np.arange(6, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_in_either_byte_order(tmp_path, endianess):
    path = tmp_path / f"values-{endianess.name}.gguf"
    write_every_value_type(path, endianess)
    assert_same_as_gguf_reader(path)
    fields = read_gguf_file(path).fields
    assert fields["t.strs"] == ["a", "", "ü" * 40] and fields["t.bools"] == [True, False, True]
    assert fields["t.6.u64"] == 2**63 + 5


def test_broken_files_are_value_errors_saying_what_is_wrong(tmp_path):
    good = tmp_path / "good.gguf"
    write_every_value_type(good)
    data = good.read_bytes()
    cases = {"magic.gguf": (b"GGUX" + data[4:], "magic"),
             "version.gguf": (data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
             "header.gguf": (data[:60], "ends early|runs past"),
             "data.gguf": (data[:-24], "tensor 'h'.*truncated")}
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_gguf_file(tmp_path / name)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="no madvise")
def test_released_tensor_pages_leave_the_rss_and_read_back_the_same(tmp_path):
    """Issue 48: a tensor's mapped pages, once read, counted in the RSS for as long as the
    checkpoint stayed open, a second copy of every loaded tensor. `mapped.release()` drops
    them; the data reads back unchanged (faulted in from the file again)."""
    values = np.arange(8 << 20, dtype=np.float32).reshape(2048, -1)  # 32 MiB
    writer = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    writer.add_tensor("big", values)
    writer.add_tensor("small", np.ones(3, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    big, small = read_gguf_file(tmp_path / "big.gguf").tensors
    assert big.mapped.nbytes == values.nbytes
    assert float(big.data.sum(dtype=np.float64)) == float(values.sum(dtype=np.float64))
    resident = _rss_bytes()
    big.mapped.release()
    assert resident - _rss_bytes() > values.nbytes // 2
    assert np.array_equal(big.data, values) and np.array_equal(small.data, np.ones(3))
    small.mapped.release()  # its start is not on a page boundary
    assert np.array_equal(small.data, np.ones(3))
