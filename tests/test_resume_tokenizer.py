"""A resume onto shards of another tokenizer names the tokenizer difference (issue 28 item 4).

Seen red before the fix: the run resumed (exit 0) onto shards whose ids mean other bytes: a permuted
byte tokenizer gives the same token count and the same source hash, so the loader's checks
(num_windows, source_sha256) saw nothing; with another token count the message was "saved
num_windows=622, now 702", which does not say why.
"""

from __future__ import annotations

from pathlib import Path

from entrenar.data.corpus import pack
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import STDLIB, ByteTokenizer


class PermutedByteTokenizer(ByteTokenizer):
    """258 tokens like ByteTokenizer, but byte b is id 255 - b: the same text, other ids."""

    def __init__(self) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        from entrenar.tokenizer import BYTE_TO_UNICODE

        tok = Tokenizer(models.BPE({ch: 255 - b for b, ch in BYTE_TO_UNICODE.items()}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<bos>", special=True)])
        self.tokenizer = tok

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return [255 - b for b in text.encode("utf-8")]


def _args(data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["pretrain", "--model", "tiny", "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--seq-len", "32", "--batch-size", "2", "--save-every", "2", "--eval-every", "0", "--no-preflight",
            "--json", *extra]


def test_resume_onto_shards_of_another_tokenizer_names_both_tokenizers(tmp_path, capsys):
    mine, other = tmp_path / "mine", tmp_path / "other"
    pack([str(STDLIB / "decoder.py")], ByteTokenizer(), mine, seed=1)
    pack([str(STDLIB / "decoder.py")], PermutedByteTokenizer(), other, seed=1)
    run = tmp_path / "run"
    code, _, err = main(_args(mine, run, 2), capsys)
    assert code == 0, err[-3000:]
    code, result, err = main(_args(other, run, 4, "--resume", "auto"), capsys)
    assert code == 2, err[-3000:]
    assert "another tokenizer" in result["error"] and str(other) in result["error"]
    assert "num_windows" not in result["error"]
    code, _, err = main(_args(mine, run, 4, "--resume", "auto"), capsys)  # its own shards: continues
    assert code == 0, err[-3000:]
