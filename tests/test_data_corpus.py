"""`entrenar data pack` and PretrainLoader, with small word-level tokenizers built here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from entrenar.cli import main
from entrenar.config import preset
from entrenar.data import corpus
from entrenar.data.corpus import PretrainLoader, pack, read_index
from entrenar.errors import InputError
from entrenar.model import CausalLM
from tests.helpers.tokenizers import WORDS, WordTokenizer


def make_corpus(root, n_docs: int = 12, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for _ in range(n_docs)]
    (root / "a").mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs[:4]):
        (root / "a" / f"doc{i}.txt").write_text(d + "\n")
    (root / "a" / "code.py").write_text(docs[4] + "\n")
    (root / "rows.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[5:]))
    return docs


def stream(out, split: str) -> np.ndarray:
    index = read_index(out)
    return np.concatenate([np.fromfile(out / s["file"], dtype=index["dtype"])
                           for s in index["splits"][split]["shards"]]).astype(np.int64)


def test_pack_writes_documents_with_eos_between(tmp_path):
    tok = WordTokenizer()
    docs = make_corpus(tmp_path)
    index = pack([str(tmp_path / "a"), str(tmp_path / "rows.jsonl")], tok, tmp_path / "out", shard_tokens=50)
    assert index["dtype"] == "uint16" and index["documents"] == len(docs)
    train = index["splits"]["train"]
    assert len(train["shards"]) > 1 and all(s["tokens"] <= 50 for s in train["shards"])
    toks = stream(tmp_path / "out", "train")
    assert len(toks) == train["tokens"] == index["tokens"]
    # files in sorted order (code.py, doc0..3), then the JSONL rows
    order = [docs[4], *docs[:4], *docs[5:]]
    expected = [t for d in order for t in tok.encode(d) + [tok.eos_id]]
    assert toks.tolist() == expected
    starts = np.fromfile(tmp_path / "out" / "train.docs.bin", dtype="<u8").tolist()
    assert starts == np.cumsum([0] + [len(tok.encode(d)) + 1 for d in order[:-1]]).tolist()
    assert index["tokenizer"]["eos_id"] == 2 and index["tokenizer"]["sha256"]


def test_pack_uses_uint32_for_large_vocabularies(tmp_path):
    tok = WordTokenizer(vocab_size=70_000)
    (tmp_path / "d.txt").write_text("x69999 w1 w2")
    index = pack([str(tmp_path / "d.txt")], tok, tmp_path / "out")
    assert index["dtype"] == "uint32"
    assert stream(tmp_path / "out", "train").tolist() == [69999, 4, 5, 2]


def test_pack_is_deterministic_and_splits_by_document(tmp_path):
    tok = WordTokenizer()
    make_corpus(tmp_path, n_docs=60)
    inputs = [str(tmp_path / "a"), str(tmp_path / "rows.jsonl")]
    i1 = pack(inputs, tok, tmp_path / "o1", val_fraction=0.3, seed=3)
    pack(inputs, tok, tmp_path / "o2", val_fraction=0.3, seed=3)
    i3 = pack(inputs, tok, tmp_path / "o3", val_fraction=0.3, seed=4)
    for split in ("train", "val"):
        assert stream(tmp_path / "o1", split).tolist() == stream(tmp_path / "o2", split).tolist()
    assert (tmp_path / "o1" / "index.json").read_text() == (tmp_path / "o2" / "index.json").read_text()
    assert i1["splits"]["val"]["documents"] > 0 and i1["splits"]["train"]["documents"] > 0
    assert i1["splits"]["val"]["documents"] + i1["splits"]["train"]["documents"] == 60
    assert i3["splits"]["val"]["tokens"] != i1["splits"]["val"]["tokens"]  # the seed picks the split
    # Every val document is whole: each one ends with EOS exactly once.
    val = stream(tmp_path / "o1", "val")
    assert val[-1] == tok.eos_id and (val == tok.eos_id).sum() == i1["splits"]["val"]["documents"]
    # Re-packing into the same directory is refused (issue 18 item 10); --overwrite replaces it.
    before = (tmp_path / "o1" / "index.json").read_text()
    with pytest.raises(InputError, match="already exists.*--overwrite"):
        pack(inputs, tok, tmp_path / "o1", val_fraction=0.1, seed=3)
    assert (tmp_path / "o1" / "index.json").read_text() == before
    pack(inputs, tok, tmp_path / "o1", val_fraction=0.3, seed=3, overwrite=True)
    assert stream(tmp_path / "o1", "val").tolist() == val.tolist()

    # Mutation: an unseeded split decision makes re-runs differ.
    monkey_rng = np.random.default_rng()
    real = corpus._doc_in_val
    try:
        corpus._doc_in_val = lambda text, seed, frac: bool(monkey_rng.random() < frac)
        a = pack(inputs, tok, tmp_path / "m1", val_fraction=0.3, seed=3)
        b = pack(inputs, tok, tmp_path / "m2", val_fraction=0.3, seed=3)
    finally:
        corpus._doc_in_val = real
    assert a["splits"]["val"]["tokens"] != b["splits"]["val"]["tokens"] or \
        stream(tmp_path / "m1", "val").tolist() != stream(tmp_path / "m2", "val").tolist()


def byte_level_bpe(texts: list[str]) -> Tokenizer:
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_big_text_files_stream_in_pieces_with_the_same_tokens(tmp_path, monkeypatch):
    """Files larger than BIG_DOC_BYTES are read in blocks and encoded in pieces, cut only after a
    newline followed by a letter: the tokens equal whole-text encoding (byte-level BPE, indented code)."""
    import inspect

    source = inspect.getsource(corpus) + "\n\n    indented\n\tx  \n  \n\n" + inspect.getsource(json)
    tok = WordTokenizer()
    tok.tokenizer = byte_level_bpe([source])
    tok.eos_id = tok.tokenizer.token_to_id("</s>")
    (tmp_path / "big.py").write_text(source)
    whole = tok.tokenizer.encode(source).ids + [tok.eos_id]
    monkeypatch.setattr(corpus, "BIG_DOC_BYTES", 1000)
    monkeypatch.setattr(corpus, "PIECE_CHARS", 300)
    assert len(corpus.split_safely(source, 300)) > 5
    streamed = pack([str(tmp_path / "big.py")], tok, tmp_path / "streamed")
    assert streamed["documents"] == 1
    assert stream(tmp_path / "streamed", "train").tolist() == whole
    # Mutation: cutting after any newline (not only before a letter) splits "\n" + indentation.
    monkeypatch.setattr(corpus, "_SAFE_CUT", __import__("re").compile(r"\n"))
    monkeypatch.setattr(corpus, "_SAFE_CUT_BYTES", __import__("re").compile(rb"\n"))
    pack([str(tmp_path / "big.py")], tok, tmp_path / "mutated")
    assert stream(tmp_path / "mutated", "train").tolist() != whole


def test_pack_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch):
    tok = WordTokenizer()
    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\n{"txt": "w2"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: .*\"text\""):
        pack([str(tmp_path / "bad.jsonl")], tok, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))
    (tmp_path / "broken.jsonl").write_text('{"text": "w1"}\n{oops\n')
    with pytest.raises(InputError, match="broken.jsonl:2: malformed JSON"):
        pack([str(tmp_path / "broken.jsonl")], tok, tmp_path / "out")
    with pytest.raises(InputError, match="no glob match"):
        pack([str(tmp_path / "nothing*.txt")], tok, tmp_path / "out")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.me").write_text("x")
    (tmp_path / "ok.txt").write_text("w1 w2")
    with pytest.raises(InputError, match="already exists"):
        pack([str(tmp_path / "ok.txt")], tok, tmp_path / "other")
    with pytest.raises(InputError, match="not an empty directory or a previous .* --overwrite will not delete"):
        pack([str(tmp_path / "ok.txt")], tok, tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "keep.me").read_text() == "x"
    # Through the CLI: exit 2 with the file:line message.
    monkeypatch.setattr("entrenar.cli.data._load_tokenizer", lambda spec: tok)
    rc = main(["data", "pack", "--model", "any", "--out", str(tmp_path / "out"), str(tmp_path / "bad.jsonl")])
    assert rc == 2 and "bad.jsonl:2:" in capsys.readouterr().err


def test_pack_cli_with_an_hf_tokenizer_dir(tmp_path, capsys):
    tok = WordTokenizer()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tok.tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    make_corpus(tmp_path / "data")
    rc = main(["data", "pack", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--val-fraction", "0.2",
               "--json", str(tmp_path / "data")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["documents"] == 12 and out["dtype"] == "uint16"
    assert out["tokens"] == sum(v["tokens"] for v in out["splits"].values())


@pytest.fixture
def shards(tmp_path):
    tok = WordTokenizer()
    make_corpus(tmp_path, n_docs=30)
    pack([str(tmp_path / "a"), str(tmp_path / "rows.jsonl")], tok, tmp_path / "out", shard_tokens=64)
    return tmp_path / "out"


def test_pretrain_windows_are_shifted_and_cover_the_stream(shards):
    toks = stream(shards, "train")
    loader = PretrainLoader(shards, "train", seq_len=16, batch_size=4, seed=0)
    assert len(loader) == (len(toks) - 1) // 16
    seen = []
    for batch in loader.iter_epoch():
        assert batch["input_ids"].dtype == torch.long
        for row, w in enumerate(batch["sample_ids"]):
            assert batch["input_ids"][row].tolist() == toks[w * 16:w * 16 + 16].tolist()
            assert batch["labels"][row].tolist() == toks[w * 16 + 1:w * 16 + 17].tolist()
            seen.append(w)
    assert seen == list(range(len(loader)))
    # next_batch: one epoch visits every window once, in a seeded order, reshuffled per epoch
    epoch0 = []
    while loader.epoch == 0:
        epoch0.extend(loader.next_batch()["sample_ids"])
    n = len(loader)
    assert sorted(epoch0[:n]) == list(range(n)) and epoch0[:n] != list(range(n))
    assert loader._epoch_order(0).tolist() != loader._epoch_order(1).tolist()


def test_doc_mask_keeps_attention_inside_documents(shards):
    loader = PretrainLoader(shards, "train", seq_len=48, batch_size=2, seed=0, doc_mask=True)
    batch = next(loader.iter_epoch())
    doc, labels, ids = batch["doc_ids"], batch["labels"], batch["input_ids"]
    assert doc[0, 0] == 0 and int(doc[0].max()) >= 1  # several documents in one window
    # the EOS position never predicts the next document's first token; positions restart
    eos_rows, eos_cols = torch.nonzero(ids == 2, as_tuple=True)
    for r, c in zip(eos_rows.tolist(), eos_cols.tolist()):
        if c + 1 < ids.shape[1]:
            assert labels[r, c] == -100 and doc[r, c + 1] == doc[r, c] + 1
            assert batch["position_ids"][r, c + 1] == 0
    n_boundaries = int((doc[:, 1:] != doc[:, :-1]).sum())
    assert int((labels == -100).sum()) == n_boundaries
    # the model: perturbing the first document leaves later documents' logits unchanged
    cfg = preset("tiny").replace(vocab_size=64)
    model = CausalLM(cfg)
    model.init_weights(seed=0)
    model = model.double().eval()
    perturbed = ids.clone()
    perturbed[0, doc[0] == 0] = (perturbed[0, doc[0] == 0] + 5) % 64
    later = doc[0] > 0
    with torch.no_grad():
        a = model(ids, doc_ids=doc)[0]
        b = model(perturbed, doc_ids=doc)[0]
        c = model(ids)[0]
        d = model(perturbed)[0]
    assert torch.equal(a[later], b[later])
    assert not torch.allclose(c[later], d[later])  # mutation: without doc_ids they do change


def test_pretrain_loader_resume_is_exact(shards, monkeypatch):
    kw = {"seq_len": 8, "batch_size": 3, "doc_mask": True}
    reference = PretrainLoader(shards, "train", seed=7, **kw)
    n = len(reference)
    k_boundary = n // math.gcd(n, 3)  # the first batch count that ends exactly on an epoch boundary
    steps = k_boundary + 3
    expected = [reference.next_batch() for _ in range(steps)]
    assert reference.epoch >= 1
    cases = set()
    for k in (1, k_boundary // 2, k_boundary - 1, k_boundary):
        first = PretrainLoader(shards, "train", seed=7, **kw)
        for _ in range(k):
            first.next_batch()
        state = first.state_dict()
        cases.add("boundary" if state["position"] == 0 else "mid")
        resumed = PretrainLoader(shards, "train", seed=99, **kw)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # states survive JSON (checkpoints)
        for i in range(k, steps):
            got = resumed.next_batch()
            assert all(torch.equal(got[key], expected[i][key]) for key in ("input_ids", "labels", "doc_ids"))
            assert got["sample_ids"] == expected[i]["sample_ids"]
    assert cases == {"boundary", "mid"}, (n, cases)

    # Mutation: restoring the position but not the RNG seed diverges.
    real = PretrainLoader.load_state_dict
    monkeypatch.setattr(PretrainLoader, "load_state_dict", lambda self, sd: real(self, {**sd, "seed": self.seed}))
    first = PretrainLoader(shards, "train", seed=7, **kw)
    first.next_batch()
    resumed = PretrainLoader(shards, "train", seed=99, **kw)
    resumed.load_state_dict(first.state_dict())
    assert resumed.next_batch()["sample_ids"] != expected[1]["sample_ids"]


def test_pretrain_loader_refuses_bad_input(shards, tmp_path):
    with pytest.raises(InputError, match="too few"):
        PretrainLoader(shards, "train", seq_len=10**6, batch_size=1)
    with pytest.raises(InputError, match="no index.json"):
        PretrainLoader(tmp_path, "train", seq_len=8, batch_size=1)
    loader = PretrainLoader(shards, "train", seq_len=8, batch_size=1)
    with pytest.raises(InputError, match="seq_len"):
        PretrainLoader(shards, "train", seq_len=9, batch_size=1).load_state_dict(loader.state_dict())
    shard = shards / read_index(shards)["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(InputError, match="re-run"):
        PretrainLoader(shards, "train", seq_len=8, batch_size=1)
