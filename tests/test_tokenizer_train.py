"""`entrenar tokenizer train`: byte-level BPE that transformers loads with identical ids."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from entrenar.cli import main
from entrenar.errors import InputError
from entrenar.tokenizer import load_tokenizer
from entrenar.tokenizer_train import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

CODE = '''def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)  # amortised O(1)

    def pop(self):
        return self.items.pop()
'''
PROSE = ("The quick brown fox jumps over the lazy dog. It's 2024; we've seen 1,234,567 foxes. "
         "Ünïcödé tëxt, 日本語のテキスト, emoji 🦊🐶 and tabs\tand\r\nwindows newlines.\n")


def write_corpus(root, copies: int = 6) -> None:
    (root / "src").mkdir(parents=True, exist_ok=True)
    for i in range(copies):
        (root / "src" / f"mod{i}.py").write_text(CODE.replace("fibonacci", f"fib{i}"))
    (root / "notes.md").write_text(PROSE * 5)
    rows = [{"text": PROSE.replace("fox", w)} for w in ("cat", "owl", "elk", "yak")]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(root / "more.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": CODE.upper()}) + "\n" for _ in range(2)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    write_corpus(root / "corpus")
    report = train_tokenizer([str(root / "corpus")], 420, root / "tok")
    return root, report


def sample_strings(n: int = 200) -> list[str]:
    rng = random.Random(0)
    fixed = [CODE, PROSE, "", " ", "    ", "\n\n\n", "\t\t x", "a  b   c    d", "x=1;y=22;z=333;w=4444",
             "<|endoftext|>", "a<|im_start|>user\nhi<|im_end|>b", "<|im_end|><|im_end|>", "don't DON'T I'M",
             "  leading and trailing  ", "naïve café", "😀" * 3, "\x00\x01\x7f", "price: $12.50!!", "ЖЖЖ ж"]
    alphabet = list("abcXYZ012 _\t\n.,;:'\"()[]{}#<>|éü日本🦊\r") + ["<|endoftext|>", "<|im_end|>", "    "]
    out = list(fixed)
    while len(out) < n:
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    return out[:n]


def test_ids_equal_autotokenizer_for_200_strings_and_chats(trained):
    transformers = pytest.importorskip("transformers")
    root, report = trained
    ours = load_tokenizer(root / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(str(root / "tok"))
    assert report["vocab_size"] == len(ours) == len(hf) == 420
    assert [ours.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert ours.eos_token == "<|endoftext|>" and ours.eot_token == "<|im_end|>" and not ours.add_bos
    for s in sample_strings():
        assert ours.encode(s) == hf(s)["input_ids"], repr(s)
        assert hf.decode(ours.encode(s)) == ours.decode(ours.encode(s))
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CODE},
              {"role": "assistant", "content": "    return n\n"}, {"role": "user", "content": PROSE}]]
    for messages in chats:
        for gen in (False, True):
            want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
            assert ours.encode_chat(messages, add_generation_prompt=gen).ids == list(want)
            assert ours.render_chat(messages, gen).text == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    assert ours.chat_template == CHATML_TEMPLATE


def test_decode_encode_is_the_identity_for_random_bytes(trained):
    root, _ = trained
    tok = load_tokenizer(root / "tok")
    rng = random.Random(1)
    for _ in range(300):
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
        text = raw.decode("utf-8", errors="replace")  # any byte string, as the text it decodes to
        assert tok.decode(tok.encode(text)) == text
        # every byte is a token: no unknown ids, no id outside the vocabulary
        assert all(0 <= i < len(tok) for i in tok.encode(text))
    for _ in range(100):  # any code point outside the surrogates
        text = "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xa0, 0xd800),
                                       rng.randrange(0xe000, 0x110000)])) for _ in range(20))
        assert tok.decode(tok.encode(text)) == text


def test_same_input_gives_identical_tokenizer_json(trained, tmp_path):
    root, _ = trained
    train_tokenizer([str(root / "corpus")], 420, tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (root / "tok" / "tokenizer.json").read_bytes()
    assert (tmp_path / "again" / "tokenizer_config.json").read_bytes() == \
        (root / "tok" / "tokenizer_config.json").read_bytes()


def test_cli_skips_undecodable_files_and_strict_exits_2(tmp_path, capsys):
    write_corpus(tmp_path / "c", copies=2)
    (tmp_path / "c" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    rc = main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "t"), "--json",
               str(tmp_path / "c")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["skipped"]["count"] == 1
    assert "latin1.txt" in out["skipped"]["listed"][0] and "not UTF-8" in out["skipped"]["listed"][0]
    assert (tmp_path / "t" / "tokenizer.json").is_file()
    # an existing --out is refused (nothing replaced) unless --overwrite
    before = (tmp_path / "t" / "tokenizer.json").read_bytes()
    rc = main(["tokenizer", "train", "--vocab-size", "280", "--out", str(tmp_path / "t"), str(tmp_path / "c")])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "t" / "tokenizer.json").read_bytes() == before
    rc = main(["tokenizer", "train", "--vocab-size", "280", "--out", str(tmp_path / "t"), "--overwrite",
               str(tmp_path / "c")])
    assert rc == 0 and len(load_tokenizer(tmp_path / "t")) == 280
    rc = main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "s"), "--strict",
               str(tmp_path / "c")])
    assert rc == 2 and "latin1.txt" in capsys.readouterr().err and not (tmp_path / "s").exists()
    with pytest.raises(InputError, match="too small"):
        train_tokenizer([str(tmp_path / "c")], 100, tmp_path / "x")


def test_a_tokenizer_directory_is_a_model_spec_for_data_commands(trained, tmp_path, capsys):
    root, _ = trained
    rows = [{"messages": [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "3"}]}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    rc = main(["data", "check", "--model", str(root / "tok"), "--data", str(tmp_path / "sft.jsonl"),
               "--max-seq-len", "64", "--json"])
    assert rc == 0, capsys.readouterr().err
    rc = main(["data", "pack", "--model", str(root / "tok"), "--out", str(tmp_path / "shards"), "--json",
               str(root / "corpus")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["tokens"] > 0


def test_parquet_and_jsonl_gz_inputs_train_the_same_tokenizer_as_jsonl(tmp_path):
    """tokenizer train reads the same input kinds as data pack; the texts, not their container, decide."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [CODE, PROSE, CODE.replace("items", "things"), PROSE.upper()] * 3
    rows = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet", row_group_size=5)
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet"):
        train_tokenizer([str(tmp_path / name)], 330, tmp_path / f"tok-{name}")
    want = (tmp_path / "tok-a.jsonl" / "tokenizer.json").read_bytes()
    assert (tmp_path / "tok-b.jsonl.gz" / "tokenizer.json").read_bytes() == want
    assert (tmp_path / "tok-c.parquet" / "tokenizer.json").read_bytes() == want
