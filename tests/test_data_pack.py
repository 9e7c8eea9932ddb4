"""`entrenar data pack` at scale: input kinds, skipped files, --strict, --workers, atomicity,
self-contained shards (the tokenizer travels in the shard directory)."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from entrenar.cli import main
from entrenar.data import corpus, sources
from entrenar.data.corpus import pack, read_index
from entrenar.errors import InputError
from entrenar.fileio import sha256_file
from entrenar.tokenizer import load_tokenizer
from entrenar.tokenizer_train import train_tokenizer

TEXTS = [f"def f{i}(x):\n    return x * {i}  # doc {i}\n" + "word " * (i % 7) for i in range(40)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("packtok")
    (root / "c.txt").write_text("".join(TEXTS) * 3)
    train_tokenizer([str(root / "c.txt")], 320, root / "tok")
    return root / "tok"


def all_bytes(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def tokens(out, split="train") -> list[int]:
    index = read_index(out)
    return np.concatenate([np.fromfile(out / s["file"], dtype=index["dtype"])
                           for s in index["splits"][split]["shards"]]).tolist()


def messy_tree(root):
    (root / "good").mkdir(parents=True)
    for i, t in enumerate(TEXTS[:20]):
        (root / "good" / f"m{i:02d}.py").write_text(t)
    (root / "good" / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[20:30]))
    (root / "good" / "latin1.py").write_bytes("# caf\xe9\nx = 1\n".encode("latin-1"))
    (root / "good" / "locked.txt").write_text("secret")
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[30:]).encode())
    (root / "good" / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated download
    return root / "good"


@pytest.fixture
def unreadable(monkeypatch):
    """locked.txt cannot be opened (chmod 000 does not stop root, so the open is refused here)."""
    real = sources._open_binary

    def fake(path):
        if path.name == "locked.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(sources, "_open_binary", fake)


def test_bad_files_are_skipped_counted_and_listed(tmp_path, tok_dir, unreadable, capsys):
    tree = messy_tree(tmp_path)
    rc = main(["data", "pack", "--model", str(tok_dir), "--out", str(tmp_path / "out"), "--json", str(tree)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["skipped"]["count"] == 3
    listed = "\n".join(out["skipped"]["listed"])
    assert "latin1.py" in listed and "not UTF-8" in listed
    assert "locked.txt" in listed and "cannot be read" in listed
    assert "cut.jsonl.gz" in listed and "truncated or corrupt gzip" in listed
    index = read_index(tmp_path / "out")
    assert index["skipped"] == out["skipped"] and index["documents"] == 30
    assert not any(name.endswith(("latin1.py", "locked.txt", "cut.jsonl.gz")) for name in index["inputs"])
    # the half-readable gzip contributed nothing (a file is used whole or not at all)
    tok = load_tokenizer(tok_dir)
    want = [t for text in [*TEXTS[:20], *TEXTS[20:30]] for t in tok.encode(text) + [tok.eos_id]]
    assert tokens(tmp_path / "out") == want


def test_strict_exits_2_and_writes_nothing(tmp_path, tok_dir, unreadable, capsys):
    tree = messy_tree(tmp_path)
    rc = main(["data", "pack", "--model", str(tok_dir), "--out", str(tmp_path / "out"), "--strict", str(tree)])
    err = capsys.readouterr().err
    assert rc == 2 and "--strict" in err and "cut.jsonl.gz" in err
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_workers_2_shards_are_byte_identical_to_workers_1(tmp_path, tok_dir, monkeypatch):
    tree = messy_tree(tmp_path)
    (tree / "latin1.py").unlink()
    (tree / "locked.txt").unlink()
    # a large first file: its task finishes last (also when the second spawned worker starts late on a loaded
    # machine: the mutation below was missed once at 200 copies), so completion order would differ
    (tree / "a_big.py").write_text("".join(TEXTS) * 1000)
    monkeypatch.setattr(corpus, "TASK_BYTES", 200)  # many tasks, so both workers get some
    tok = load_tokenizer(tok_dir)
    one = pack([str(tree)], tok, tmp_path / "w1", val_fraction=0.2, shard_tokens=97, workers=1)
    two = pack([str(tree)], tok, tmp_path / "w2", val_fraction=0.2, shard_tokens=97, workers=2)
    assert len(corpus._tasks(corpus.expand_inputs([str(tree)]))) > 4
    assert one == two and one["skipped"]["count"] == 1 and one["splits"]["val"]["documents"] > 0
    assert all_bytes(tmp_path / "w1") == all_bytes(tmp_path / "w2")


def test_parquet_and_jsonl_gz_give_the_same_tokens_as_jsonl(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS))
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), tmp_path / "c.parquet",
                   row_group_size=7)
    tok = load_tokenizer(tok_dir)
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet"):
        pack([str(tmp_path / name)], tok, tmp_path / f"out-{name}", val_fraction=0.25)
    for split in ("train", "val"):
        want = tokens(tmp_path / "out-a.jsonl", split)
        assert tokens(tmp_path / "out-b.jsonl.gz", split) == want
        assert tokens(tmp_path / "out-c.parquet", split) == want
    # a Parquet file without a text column is skipped with the columns named
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "d.parquet")
    index = pack([str(tmp_path / "d.parquet"), str(tmp_path / "a.jsonl")], tok, tmp_path / "out-d")
    assert index["skipped"]["count"] == 1 and "no \"text\" column (columns: body)" in index["skipped"]["listed"][0]


def test_shards_carry_their_tokenizer(tmp_path, tok_dir):
    (tmp_path / "c.txt").write_text(TEXTS[0])
    index = pack([str(tmp_path / "c.txt")], load_tokenizer(tok_dir), tmp_path / "out")
    files = index["tokenizer"]["files"]
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(files)
    for name, digest in files.items():
        assert sha256_file(tmp_path / "out" / name) == digest
    again = load_tokenizer(tmp_path / "out")  # the shard directory is itself a tokenizer spec
    assert again.encode(TEXTS[3]) == load_tokenizer(tok_dir).encode(TEXTS[3])
    assert again.chat_template == load_tokenizer(tok_dir).chat_template


def test_an_interrupted_pack_leaves_nothing_that_looks_complete(tmp_path, tok_dir, monkeypatch):
    (tmp_path / "in").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(t)
    monkeypatch.setattr(corpus, "TASK_BYTES", 100)
    calls = {"n": 0}
    real = corpus._encode_task

    def interrupted(paths, ctx):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(paths, ctx)

    monkeypatch.setattr(corpus, "_encode_task", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack([str(tmp_path / "in")], load_tokenizer(tok_dir), tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_all_inputs_unusable_is_exit_2_naming_them(tmp_path, tok_dir):
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(InputError, match=r"no training documents.*1 skipped.*x.txt"):
        pack([str(tmp_path / "x.txt")], load_tokenizer(tok_dir), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_utf8_bom_is_not_text(tmp_path, tok_dir):
    (tmp_path / "bom.py").write_bytes("\ufeffx = 1\n".encode())
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "x = 1\n"}) + "\n").encode())
    tok = load_tokenizer(tok_dir)
    for name in ("bom.py", "bom.jsonl"):
        pack([str(tmp_path / name)], tok, tmp_path / f"out-{name}")
        assert tokens(tmp_path / f"out-{name}") == tok.encode("x = 1\n") + [tok.eos_id]


def test_skipped_files_are_all_counted_and_the_first_20_listed(tmp_path, tok_dir):
    (tmp_path / "in").mkdir()
    for i in range(25):
        (tmp_path / "in" / f"bad{i:02d}.txt").write_bytes(b"\xff not utf-8")
    (tmp_path / "in" / "good.txt").write_text(TEXTS[0])
    index = pack([str(tmp_path / "in")], load_tokenizer(tok_dir), tmp_path / "out")
    assert index["skipped"]["count"] == 25 and len(index["skipped"]["listed"]) == 20
    assert index["skipped"]["listed"][0].startswith(str(tmp_path / "in" / "bad00.txt"))
    assert index["documents"] == 1
