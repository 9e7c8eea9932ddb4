"""PretrainLoader's window arithmetic at its edges, and pack's validation split as a fraction of documents.

A window is seq_len + 1 tokens (inputs and shifted labels), so a stream of exactly k x seq_len tokens holds
k - 1 windows, not k; a loader that counted k would read past the stream's end on its last window. These
tests build streams of known length (one word = one token, one EOS per document) to sit on those edges.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from entrenar.data import corpus
from entrenar.data.corpus import PretrainLoader, pack, read_index
from entrenar.errors import GuardError, InputError
from tests.helpers.tokenizers import WORDS, WordTokenizer


def one_doc_shards(tmp_path, n_tokens: int, shard_tokens: int = 7):
    """A pack whose train stream is exactly n_tokens long: one document of n_tokens - 1 words + its EOS,
    cut into shards of shard_tokens (windows cross shard borders)."""
    words = [WORDS[i % len(WORDS)] for i in range(n_tokens - 1)]
    src = tmp_path / f"doc{n_tokens}.txt"
    src.write_text(" ".join(words) + "\n")
    out = tmp_path / f"shards{n_tokens}"
    pack([str(src)], WordTokenizer(), out, shard_tokens=shard_tokens)
    assert read_index(out)["splits"]["train"]["tokens"] == n_tokens
    return out


@pytest.mark.parametrize("n_tokens,seq_len,windows", [(32, 16, 1), (33, 16, 2), (32, 8, 3), (32, 31, 1),
                                                      (32, 15, 2)])
def test_a_window_needs_seq_len_plus_one_tokens(tmp_path, n_tokens, seq_len, windows):
    shards = one_doc_shards(tmp_path, n_tokens)
    loader = PretrainLoader(shards, "train", seq_len=seq_len, batch_size=2)
    assert len(loader) == windows
    stream = np.concatenate([np.fromfile(shards / s["file"], dtype="<u2")
                             for s in read_index(shards)["splits"]["train"]["shards"]]).astype(np.int64)
    read = 0
    for batch in loader.iter_epoch():  # every window readable, inputs and labels one token apart
        for row, w in enumerate(batch["sample_ids"]):
            assert batch["input_ids"][row].tolist() == stream[w * seq_len:(w + 1) * seq_len].tolist()
            assert batch["labels"][row].tolist() == stream[w * seq_len + 1:(w + 1) * seq_len + 1].tolist()
            read += 1
    assert read == windows
    for _ in range(windows + 1):  # and the endless sampler too, across an epoch boundary
        loader.next_batch()


def test_a_stream_of_exactly_seq_len_tokens_has_no_window(tmp_path):
    shards = one_doc_shards(tmp_path, 16)
    with pytest.raises(InputError, match="too few"):
        PretrainLoader(shards, "train", seq_len=16, batch_size=1)
    assert len(PretrainLoader(shards, "train", seq_len=15, batch_size=1)) == 1


def test_loader_sizes_must_be_positive(tmp_path):
    shards = one_doc_shards(tmp_path, 32)
    for seq_len, batch in ((0, 1), (1, 0), (0, 0), (-3, 2)):
        with pytest.raises(InputError, match="seq_len and batch_size must be >= 1"):
            PretrainLoader(shards, "train", seq_len=seq_len, batch_size=batch)
    loader = PretrainLoader(shards, "train", seq_len=1, batch_size=1)  # the smallest legal sizes work
    assert len(loader) == 31 and loader.next_batch()["input_ids"].shape == (1, 1)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_validation_documents_are_the_asked_fraction(fraction):
    """_doc_in_val hashes each document to [0, 1) and keeps those under the fraction: over 4,000 documents the
    share sits within 4 binomial standard deviations of it (a hash scaled by 2^65 would halve it)."""
    n = 4000
    share = sum(corpus._doc_in_val(f"document {i} body", seed=3, val_fraction=fraction) for i in range(n)) / n
    sd = (fraction * (1 - fraction) / n) ** 0.5
    assert abs(share - fraction) < 4 * sd
    assert not any(corpus._doc_in_val(f"document {i}", seed=3, val_fraction=0.0) for i in range(200))
    # the seed chooses which documents: another seed, another split of the same documents
    other = [corpus._doc_in_val(f"document {i} body", seed=4, val_fraction=fraction) for i in range(200)]
    assert other != [corpus._doc_in_val(f"document {i} body", seed=3, val_fraction=fraction) for i in range(200)]


@pytest.mark.parametrize("bad_offset", [0, 5])
def test_an_id_at_or_over_the_vocabulary_is_guard_data_exit_2(tmp_path, bad_offset):
    """ids >= the tokenizer's size are padding rows of a rounded-up vocabulary: the first such id (== size) is
    refused as well as larger ones, as a data error (exit 2), naming the window."""
    shards = one_doc_shards(tmp_path, 32)
    index = read_index(shards)
    first = shards / index["splits"]["train"]["shards"][0]["file"]
    ids = np.fromfile(first, dtype="<u2")
    ids[3] = index["vocab_size"] + bad_offset
    ids.tofile(first)
    loader = PretrainLoader(shards, "train", seq_len=8, batch_size=1)
    with pytest.raises(GuardError) as err:
        loader.window(0)
    assert err.value.guard_id == "GUARD-DATA" and err.value.exit_code == 2
    assert f"token id {index['vocab_size'] + bad_offset}" in str(err.value) and "window 0" in str(err.value)
    loader.window(1)  # the windows without it are fine


@pytest.mark.parametrize("doc_mask", [False, True])
def test_a_batch_equals_its_windows_read_from_the_whole_stream(tmp_path, doc_mask):
    """_collate reads every window of a batch straight into one array (shards of 7 tokens: most windows cross
    borders); against the concatenated stream and its document starts, window by window: inputs, labels
    (-100 where the next token starts another document), doc ids and the positions that restart with them."""
    src = tmp_path / "docs.jsonl"  # one document a row
    rng = np.random.default_rng(0)
    src.write_text("".join(json.dumps({"text": " ".join(WORDS[j % len(WORDS)] for j in rng.integers(0, 50, size=n))})
                           + "\n" for n in rng.integers(1, 12, size=40)))
    pack([str(src)], WordTokenizer(), tmp_path / "s", shard_tokens=7, val_fraction=0.0)
    shards = tmp_path / "s"
    info = read_index(shards)["splits"]["train"]
    stream = np.concatenate([np.fromfile(shards / s["file"], dtype="<u2") for s in info["shards"]]).astype(np.int64)
    starts = np.fromfile(shards / info["doc_offsets"], dtype="<u8").astype(np.int64)
    T = 9
    loader = PretrainLoader(shards, "train", seq_len=T, batch_size=5, doc_mask=doc_mask)
    assert len(starts) > 5 and len(info["shards"]) > 10
    windows = [0, len(loader) - 1, *rng.integers(0, len(loader), size=6).tolist()]
    batch = loader._collate(windows)
    assert batch["sample_ids"] == windows
    for row, w in enumerate(windows):
        toks = stream[w * T:w * T + T + 1]
        doc = np.searchsorted(starts, np.arange(w * T, w * T + T + 1), side="right") - 1
        labels = np.where(doc[1:] != doc[:-1], -100, toks[1:]) if doc_mask else toks[1:]
        assert batch["input_ids"][row].tolist() == toks[:-1].tolist()
        assert batch["labels"][row].tolist() == labels.tolist()
        if doc_mask:
            assert batch["doc_ids"][row].tolist() == (doc[:-1] - doc[0]).tolist()
            pos = [i - max(j for j in range(i + 1) if j == 0 or doc[j] != doc[j - 1]) for i in range(T)]
            assert batch["position_ids"][row].tolist() == pos
        assert {k: v.tolist() for k, v in loader.window(w).items()} == \
            {k: batch[k][row].tolist() for k in loader.window(w)}
    assert batch["input_ids"].is_contiguous() and batch["labels"].is_contiguous()
    assert doc_mask == bool((batch["labels"] == -100).any())  # the documents are short: windows cross them


def test_guard_data_names_the_window_of_a_batch_that_holds_the_bad_id(tmp_path):
    shards = one_doc_shards(tmp_path, 40)
    index = read_index(shards)
    first = shards / index["splits"]["train"]["shards"][1]["file"]  # stream tokens 7..13
    ids = np.fromfile(first, dtype="<u2")
    ids[4] = index["vocab_size"]  # stream position 11: windows 1 (8..16) of seq_len 8
    ids.tofile(first)
    loader = PretrainLoader(shards, "train", seq_len=8, batch_size=3)
    with pytest.raises(GuardError, match="window 1 holds token id"):
        loader._collate([0, 3, 1, 2])
    loader._collate([0, 3, 2])
