"""SFT length buckets (--pad-buckets): each batch padded to the smallest of a few fixed lengths that holds its
longest row, so the training step sees a few shapes (e.g. one CUDA graph each). The padding changes nothing
that is trained: every real sample's ids and labels are unchanged, padding labels are -100, and the summed loss of
a batch is the same with and without buckets (fp64 tiny model, 1e-12)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entrenar.config import preset
from entrenar.data import sft
from entrenar.data.sft import (
    IGNORE_INDEX,
    SFTExample,
    SFTLoader,
    bucket_lengths,
    collate_packed,
    collate_padded,
    shifted_labels,
)
from entrenar.errors import InputError
from entrenar.model import CausalLM
from entrenar.train.commands import resolve_pad_buckets
from tests.helpers.cli import run_cli as main

VOCAB = 512
PAD = 7  # a real token id: padding must be masked by position (labels), never by id


def make_examples(n: int, seed: int = 0, longest: int = 40) -> list[SFTExample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, response = int(rng.integers(2, longest // 2)), int(rng.integers(1, longest // 2))
        ids = rng.integers(3, VOCAB, size=prompt + response).astype(np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        mask[prompt:] = True
        out.append(SFTExample(ids.astype(np.int32), shifted_labels(ids, mask), i + 1, prompt, False))
    return out


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m = CausalLM(preset("tiny").replace(vocab_size=VOCAB))
    m.init_weights(seed=0)
    return m.double().eval()


# ---- bucket_lengths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_seq_len, buckets, expected", [
    (2048, 4, (512, 1024, 1536, 2048)), (1000, 3, (384, 704, 1000)), (2048, 1, (2048,)), (2048, 0, ()),
    (100, 4, (64, 100)),  # 25, 50, 75 round up to 64, 64, 128 > 100: deduplicated, the last is max_seq_len
    (130, 2, (128, 130)), (64, 3, (64,)), (4096, 3, (1408, 2752, 4096))])
def test_bucket_lengths(max_seq_len, buckets, expected):
    got = bucket_lengths(max_seq_len, buckets)
    assert got == expected
    assert all(b % 64 == 0 for b in got[:-1]) and (not got or got[-1] == max_seq_len)


@pytest.mark.parametrize("buckets", [-1, -4])
def test_bucket_lengths_negative_is_a_clear_value_error(buckets):
    with pytest.raises(ValueError, match=r"length buckets must be an integer >= 0 \(0 = pad to the longest\)"):
        bucket_lengths(2048, buckets)


def test_resolve_pad_buckets_is_the_one_decision():
    assert resolve_pad_buckets(None, 2048) == () and resolve_pad_buckets(0, 2048) == ()
    assert resolve_pad_buckets(4, 2048) == (512, 1024, 1536, 2048)
    with pytest.raises(InputError, match="--pad-buckets"):
        resolve_pad_buckets(-1, 2048)
    assert resolve_pad_buckets(None, 2048, "preference") == ()
    with pytest.raises(InputError, match="--pad-buckets"):
        resolve_pad_buckets(2, 2048, "preference")


# ---- batches: T in the buckets, real samples unchanged, padding -100 ---------------------------------------------
def _check_padded(batch: dict, examples: dict[int, SFTExample], buckets: tuple[int, ...]) -> None:
    T = batch["input_ids"].shape[1]
    assert T in buckets
    assert T == min(b for b in buckets if b >= max(len(examples[s]) for s in batch["sample_ids"]))
    for i, line in enumerate(batch["sample_ids"]):
        ex = examples[line]
        assert batch["input_ids"][i, :len(ex)].tolist() == ex.input_ids.tolist()
        assert batch["labels"][i, :len(ex)].tolist() == ex.labels.tolist()
        assert (batch["labels"][i, len(ex):] == IGNORE_INDEX).all()
        assert (batch["input_ids"][i, len(ex):] == PAD).all()


def _check_packed(batch: dict, examples: dict[int, SFTExample], buckets: tuple[int, ...]) -> None:
    B, T = batch["input_ids"].shape
    assert T in buckets
    lines = iter(batch["sample_ids"])
    longest = 0
    for b in range(B):
        doc = batch["doc_ids"][b]
        at = 0
        for d in range(int(doc.max()) + 1):
            ex = examples[next(lines)]
            n = len(ex)
            assert (doc[at:at + n] == d).all()
            assert batch["input_ids"][b, at:at + n].tolist() == ex.input_ids.tolist()
            assert batch["labels"][b, at:at + n].tolist() == ex.labels.tolist()
            assert batch["position_ids"][b, at:at + n].tolist() == list(range(n))
            at += n
        longest = max(longest, at)
        assert (doc[at:] == -1).all() and (batch["labels"][b, at:] == IGNORE_INDEX).all()
        assert (batch["input_ids"][b, at:] == PAD).all()
        assert batch["position_ids"][b, at:].tolist() == list(range(T - at))
    assert T == min(x for x in buckets if x >= longest)


def test_collate_pads_to_the_smallest_bucket_that_holds_the_longest_row():
    examples = make_examples(6, longest=30)
    by_line = {e.line: e for e in examples}
    pad_to = (8, 16, 24, 32)
    seen = set()
    for k in range(6):  # lengths 22, 20, 18, 20, 17, 12: batches of one and two samples
        for size in (1, 2):
            batch = collate_padded(examples[k:k + size], PAD, pad_to)
            _check_padded(batch, by_line, pad_to)
            seen.add(batch["input_ids"].shape[1])
    assert len(seen) >= 2  # several buckets in use
    batch = collate_packed([examples[:2], examples[2:3]], PAD, (64, 128))
    _check_packed(batch, by_line, (64, 128))
    assert collate_padded(examples[:2], PAD)["input_ids"].shape[1] == max(len(e) for e in examples[:2])  # () as today
    with pytest.raises(AssertionError, match="does not fit the last length bucket"):
        collate_padded(examples, PAD, (4,))  # never truncated


@pytest.mark.parametrize("pack", [False, True])
def test_loader_batches_take_bucket_shapes(pack):
    examples = make_examples(40, longest=60)
    by_line = {e.line: e for e in examples}
    buckets = bucket_lengths(130, 2)  # (128, 130)
    if not pack:
        buckets = (16, 32, 48, 64, 130)  # more than one bucket used by short samples
    loader = SFTLoader(examples, 3, seed=1, pack=pack, max_seq_len=130, pad_id=PAD, buckets=buckets)
    check = _check_packed if pack else _check_padded
    shapes = set()
    for batch in [loader.next_batch() for _ in range(12)] + list(loader.iter_epoch()):
        check(batch, by_line, buckets)
        shapes.add(batch["input_ids"].shape[1])
    assert len(shapes) >= 2 or pack
    # resumable: buckets recorded for information only; an old state (without them) still loads
    state = loader.state_dict()
    assert state["buckets"] == list(buckets)
    old = {k: v for k, v in state.items() if k != "buckets"}
    fresh = SFTLoader(examples, 3, seed=9, pack=pack, max_seq_len=130, pad_id=PAD, buckets=buckets)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.next_batch()["input_ids"], loader.next_batch()["input_ids"])
    with pytest.raises(InputError, match="last SFT length bucket"):
        SFTLoader(examples, 3, pack=pack, max_seq_len=130, pad_id=PAD, buckets=(32,))


def test_summed_loss_same_with_and_without_buckets(model):
    """Per batch: the fp64 summed cross-entropy from the logits agrees within 1e-12, and the training path's
    (model(ids, labels=...), which reduces in fp32) within fp32 summation order, over the same label count."""
    examples = make_examples(10, seed=3, longest=40)
    results = {}
    for name, buckets, pack in (("padded", (), False), ("padded-buckets", bucket_lengths(200, 3), False),
                                ("packed", (), True), ("packed-buckets", bucket_lengths(200, 2), True)):
        loader = SFTLoader(examples, 3, seed=0, pack=pack, max_seq_len=200, pad_id=PAD, buckets=buckets)
        sums = []
        for batch in [loader.next_batch() for _ in range(3)] + list(loader.iter_epoch()):
            kw = {"position_ids": batch.get("position_ids"), "doc_ids": batch.get("doc_ids")}
            with torch.no_grad():
                logits = model(batch["input_ids"], **kw)
                s, n = model(batch["input_ids"], labels=batch["labels"], **kw)
            assert logits.dtype == torch.float64
            ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
            sums.append((float(ce), float(s), int(n), batch["input_ids"].shape[1]))
        results[name] = sums
    for plain, bucketed in (("padded", "padded-buckets"), ("packed", "packed-buckets")):
        a, b = results[plain], results[bucketed]
        assert [r[2] for r in a] == [r[2] for r in b]
        assert all(r[3] in bucket_lengths(200, 3 if plain == "padded" else 2) for r in b)
        assert [r[3] for r in a] != [r[3] for r in b]  # really padded further
        worst = max(abs(x[0] - y[0]) for x, y in zip(a, b))
        assert worst < 1e-12, (plain, worst)
        assert max(abs(x[1] - y[1]) / abs(x[1]) for x, y in zip(a, b)) < 1e-6


# ---- the CLI ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    from tests.test_peft_seed import tiny_base_and_data

    return tiny_base_and_data(tmp_path_factory.mktemp("sftbase"))


def finetune(base, data, out, *extra, capsys=None):
    return main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--batch-size", "2",
                 "--max-seq-len", "128", "--no-preflight", "--json", *extra], capsys)


def test_cli_negative_pad_buckets_exits_2_and_writes_nothing(tmp_path, sft_base, capsys):
    base, data = sft_base
    out = tmp_path / "run"
    code, result, err = finetune(base, data, out, "--steps", "1", "--pad-buckets", "-1", capsys=capsys)
    assert code == 2, err
    assert result is not None and result["exit_code"] == 2 and "--pad-buckets" in err
    assert not out.exists()


def test_cli_finetune_with_pad_buckets_trains_on_bucket_shapes(tmp_path, sft_base, capsys, monkeypatch):
    base, data = sft_base
    shapes: list[int] = []
    real = sft.collate_padded

    def spy(examples, pad_id, pad_to=()):
        batch = real(examples, pad_id, pad_to)
        shapes.append(batch["input_ids"].shape[1])
        return batch

    monkeypatch.setattr(sft, "collate_padded", spy)
    out = tmp_path / "run"
    code, _, err = finetune(base, data, out, "--steps", "2", "--val-fraction", "0.25", "--pad-buckets", "2",
                                 capsys=capsys)
    assert code == 0, err
    assert "--pad-buckets 2: batches padded to one of 64, 128 tokens" in err
    assert shapes and set(shapes) <= {64, 128}  # the samples are 36 tokens: 64, not 36
    assert json.loads((out / "run.json").read_text())["data"]["pad_buckets"] == 2
    assert (out / "final").exists()
