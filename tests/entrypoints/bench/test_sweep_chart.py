"""The sweep's PNG chart from a hand-written result: a valid PNG of the chart's size, n/a and
error bars drawn empty, the roofline marked per batch where the result has one; a clear error
without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sweep_helpers import make_result, png_size  # noqa: E402

from mrv2.entrypoints.bench.sweep_chart import (_bars, _roofline_marks,  # noqa: E402
                                                check_matplotlib, write_chart)


def test_chart_is_a_png_of_reasonable_size(tmp_path):
    path = tmp_path / "sweep.png"
    write_chart(make_result(under_load=True), str(path))
    data = path.read_bytes()
    assert png_size(data) == (1000, 560)
    assert 10_000 < len(data) < 200_000


def test_bars_of_a_column():
    result = make_result()
    assert _bars(result, "mrv2 float32") == ([31.0, 81.0], [[1.0, 1.0], [1.0, 1.5]],
                                             ["31.0", "81.0"])
    assert _bars(result, "mrv2 gguf Q4_1")[::2] == ([36.0, 0.0], ["36.0", "error"])
    assert _bars(result, "llama.cpp gguf Q4_1")[2] == ["21.0", "n/a"]


def test_roofline_marks_each_batch_with_a_limit(tmp_path):
    result = make_result()
    assert _roofline_marks(result) == []  # a result without a roofline draws none
    result["roofline"] = {"decode_tok_s": {str(result["batch_sizes"][0]): 262.0}}
    assert _roofline_marks(result) == [(0, 262.0)]
    result["roofline"]["decode_tok_s"] = {str(b): 100.0 * (i + 1)
                                          for i, b in enumerate(result["batch_sizes"])}
    assert _roofline_marks(result) == [(0, 100.0), (1, 200.0)]
    path = tmp_path / "sweep.png"
    write_chart(result, str(path))
    assert png_size(path.read_bytes()) == (1000, 560)


def test_missing_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=r"pip install 'mrv2\[bench\]'"):
        check_matplotlib()
