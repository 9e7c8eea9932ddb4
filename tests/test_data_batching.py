"""SFT batching with a tiny random CausalLM: packed == padded per-token losses, no attention across
packed samples, exact loader resume (mid-epoch and at the epoch boundary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entrenar.config import preset
from entrenar.data.sft import IGNORE_INDEX, SFTExample, SFTLoader, shifted_labels
from entrenar.errors import InputError
from entrenar.model import CausalLM

VOCAB = 512


def make_example(rng: np.random.Generator, line: int, prompt_len: int, response_len: int) -> SFTExample:
    ids = rng.integers(3, VOCAB, size=prompt_len + response_len).astype(np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[prompt_len:] = True
    return SFTExample(ids.astype(np.int32), shifted_labels(ids, mask), line, prompt_len, False)


def make_examples(n: int, seed: int = 0) -> list[SFTExample]:
    rng = np.random.default_rng(seed)
    return [make_example(rng, i + 1, int(rng.integers(2, 12)), int(rng.integers(1, 9))) for i in range(n)]


@pytest.fixture(scope="module")
def model() -> CausalLM:
    cfg = preset("tiny").replace(vocab_size=VOCAB)
    m = CausalLM(cfg)
    m.init_weights(seed=0)
    return m.double().eval()


def per_token_losses(model: CausalLM, batch: dict, use_doc_ids: bool = True,
                     use_positions: bool = True) -> dict[tuple[int, int], float]:
    """{(sample line, position within the sample): CE} for every label of the batch."""
    doc_ids = batch.get("doc_ids") if use_doc_ids else None
    positions = batch.get("position_ids") if use_positions else None
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=positions, doc_ids=doc_ids)
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none").view(batch["labels"].shape)
    out = {}
    offset = 0
    for b in range(batch["input_ids"].shape[0]):
        if "doc_ids" in batch:  # packed: samples are docs 0, 1, ...; padding is doc -1
            doc = batch["doc_ids"][b]
            n = len(set(doc[doc >= 0].tolist()))
            pos = batch["position_ids"][b]
        else:
            doc, n = torch.zeros_like(batch["input_ids"][b]), 1
            pos = torch.arange(batch["input_ids"].shape[1])
        lines = batch["sample_ids"][offset:offset + n]
        offset += n
        for t in range(batch["labels"].shape[1]):
            if batch["labels"][b, t] != IGNORE_INDEX:
                out[(lines[int(doc[t])], int(pos[t]))] = float(ce[b, t])
    assert offset == len(batch["sample_ids"])
    return out


def all_losses(model: CausalLM, loader: SFTLoader, **kw) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for batch in loader.iter_epoch():
        out.update(per_token_losses(model, batch, **kw))
    return out


def test_packed_and_padded_batches_give_identical_per_token_losses(model):
    examples = make_examples(9)
    padded = SFTLoader(examples, 4, seed=0, pad_id=0)
    packed = SFTLoader(examples, 2, seed=0, pack=True, max_seq_len=48, pad_id=0)
    batches = list(packed.iter_epoch())
    assert any(len(set(b["doc_ids"][0].tolist()) - {-1}) > 2 for b in batches)  # rows really hold several samples
    loss_padded, loss_packed = all_losses(model, padded), all_losses(model, packed)
    assert sum(e.loss_tokens for e in examples) == len(loss_padded) == len(loss_packed)
    assert loss_padded.keys() == loss_packed.keys()
    worst = max(abs(loss_padded[k] - loss_packed[k]) for k in loss_padded)
    assert worst < 1e-10
    # The summed loss through CausalLM.loss (the training path) agrees too.
    sums = []
    for loader in (padded, packed):
        total, n = 0.0, 0
        for b in loader.iter_epoch():
            with torch.no_grad():
                s, c = model(b["input_ids"], labels=b["labels"], position_ids=b.get("position_ids"),
                                  doc_ids=b.get("doc_ids"))
            total, n = total + float(s), n + int(c)
        sums.append((total, n))
    # (the fused CE kernel reduces in fp32, hence the looser bound)
    assert sums[0][1] == sums[1][1] and abs(sums[0][0] - sums[1][0]) < 1e-6 * abs(sums[0][0])

    # Mutation: positions that do not restart per packed sample -> losses differ.
    moved = all_losses(model, packed, use_positions=False, use_doc_ids=False)
    assert max(abs(loss_padded[k] - moved.get(k, 0.0)) for k in loss_padded) > 1e-3


def test_no_attention_across_packed_samples(model):
    examples = make_examples(3, seed=1)
    loader = SFTLoader(examples, 1, seed=0, pack=True, max_seq_len=64, pad_id=0)
    batch = next(loader.iter_epoch())
    assert batch["sample_ids"] == [1, 2, 3]
    doc = batch["doc_ids"][0]
    perturbed = batch["input_ids"].clone()
    perturbed[0, doc == 1] = (perturbed[0, doc == 1] + 7) % VOCAB  # change sample 2 only

    def logits(ids, doc_ids):
        with torch.no_grad():
            return model(ids, position_ids=batch["position_ids"], doc_ids=doc_ids)[0]

    before, after = logits(batch["input_ids"], doc[None]), logits(perturbed, doc[None])
    others = (doc == 0) | (doc == 2)
    assert torch.equal(before[others], after[others])
    assert not torch.allclose(before[doc == 1], after[doc == 1])
    # Mutation: without doc_ids the third sample sees the perturbed second one.
    before, after = logits(batch["input_ids"], None), logits(perturbed, None)
    assert not torch.allclose(before[doc == 2], after[doc == 2])


def test_padding_is_masked_by_position_and_rows_are_aligned():
    examples = make_examples(5)
    batch = next(SFTLoader(examples, 5, seed=0, pad_id=0).iter_epoch())
    for i, ex in enumerate(examples):
        assert batch["input_ids"][i, :len(ex)].tolist() == ex.input_ids.tolist()
        assert (batch["labels"][i, len(ex):] == IGNORE_INDEX).all()
        assert batch["labels"][i, :len(ex)].tolist() == ex.labels.tolist()
    assert batch["sample_ids"] == [1, 2, 3, 4, 5]


def batches_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_sft_loader_resume_is_exact(pack, monkeypatch):
    examples = make_examples(6)
    kw = {"pack": pack, "max_seq_len": 24, "pad_id": 0}
    reference = SFTLoader(examples, 3, seed=5, **kw)
    expected = [reference.next_batch() for _ in range(12)]
    assert reference.epoch >= 2
    cases = set()
    for k in range(8):
        first = SFTLoader(examples, 3, seed=5, **kw)
        for _ in range(k):
            first.next_batch()
        state = first.state_dict()
        cases.add("boundary" if state["position"] == 0 and state["epoch"] > 0 else
                  "mid" if state["position"] > 0 else "start")
        resumed = SFTLoader(examples, 3, seed=123, **kw)  # the seed comes from the state
        resumed.load_state_dict(state)
        assert resumed.epoch == first.epoch
        for i in range(k, 12):
            assert batches_equal(resumed.next_batch(), expected[i]), (k, i)
    assert {"boundary", "mid"} <= cases
    # Each epoch is reshuffled (its own order from (seed, epoch)).
    assert reference._epoch_order(0).tolist() != reference._epoch_order(1).tolist()

    # Mutation: a resume that forgets the saved RNG seed gives different batches.
    real = SFTLoader.load_state_dict

    def forget_seed(self, sd):
        real(self, {**sd, "seed": self.seed})

    monkeypatch.setattr(SFTLoader, "load_state_dict", forget_seed)
    first = SFTLoader(examples, 3, seed=5, **kw)
    first.next_batch()
    resumed = SFTLoader(examples, 3, seed=123, **kw)
    resumed.load_state_dict(first.state_dict())
    assert not all(batches_equal(resumed.next_batch(), expected[i]) for i in range(1, 5))


def test_sft_loader_refuses_other_data_on_resume():
    loader = SFTLoader(make_examples(6), 2, seed=0)
    state = loader.state_dict()
    with pytest.raises(InputError, match="fingerprint"):
        SFTLoader(make_examples(6, seed=9), 2, seed=0).load_state_dict(state)


def test_packing_needs_max_seq_len_and_fitting_examples():
    with pytest.raises(InputError, match="max_seq_len"):
        SFTLoader(make_examples(3), 2, seed=0, pack=True)
    with pytest.raises(InputError, match="more than max_seq_len"):
        SFTLoader(make_examples(3), 2, seed=0, pack=True, max_seq_len=4)


def test_packed_iteration_covers_each_sample_once():
    examples = make_examples(11)
    seen = [s for b in SFTLoader(examples, 2, seed=0, pack=True, max_seq_len=20).iter_epoch()
            for s in b["sample_ids"]]
    assert seen == list(range(1, 12))
    loader = SFTLoader(examples, 2, seed=3, pack=True, max_seq_len=20)
    stream = []
    while loader.epoch == 0:
        stream.extend(loader.next_batch()["sample_ids"])
    assert sorted(stream[:11]) == list(range(1, 12))
