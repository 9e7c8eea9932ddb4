"""`export gguf` says when it re-quantizes an already quantized source into another type (issue 28
item 9): `--type q4_0` of the packaged Q4_1 SmolLM2 changed its greedy answers with no note.

Seen red before the fix: no note in the result (exit 0, silent).
"""

from __future__ import annotations

import pytest

from entrenar.export import export_gguf
from tests.test_export_gguf import exports, tiny_dirs, tok_dir  # noqa: F401 (fixtures)


@pytest.mark.parametrize(("source", "target", "lossy"), [("q8_0", "q4_0", True), ("q4_0", "q8_0", True),
                                                          ("q8_0", "f16", False), ("f16", "q4_0", False)])
def test_requantizing_a_quantized_source_is_noted(exports, tmp_path, source, target, lossy):  # noqa: F811
    out = export_gguf(str(exports["llama", source]), tmp_path / "again.gguf", target)
    notes = [n for n in out["notes"] if "re-quantiz" in n]
    assert bool(notes) == lossy, out["notes"]
    if lossy:
        assert source.upper() in notes[0] and "--type f32" in notes[0]
        assert out["requantized_from"] == [source.upper()]
    else:
        assert out["requantized_from"] is None
