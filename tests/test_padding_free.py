"""`finetune --padding-free`: each SFT batch's samples end to end in ONE row of exactly their tokens (data/sft.py's
collate_padding_free), with cu_seqlens/max_seqlen for varlen flash attention on CUDA (varlen.py). The same samples
in the same order as padded batches, the same loss and gradients, the same per-step losses in a CLI run."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entrenar import varlen
from entrenar.data.sft import (
    IGNORE_INDEX,
    SFTExample,
    SFTLoader,
    collate_padded,
    collate_padding_free,
    graph_row_length,
)
from entrenar.errors import InputError
from entrenar.peft import apply_lora
from entrenar.tensors import batch_counts
from entrenar.train.commands import check_padding_free
from entrenar.train.config import DataConfig
from entrenar.train.objective import CausalLMLoss
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_sft_buckets import make_examples

VOCAB = 97  # tiny_config's


def examples(n: int = 11, seed: int = 0) -> list[SFTExample]:
    out = make_examples(n, seed, longest=40)
    for e in out:  # make_examples draws ids below 512; the tiny model has 97
        e.input_ids %= VOCAB
        e.labels = np.where(e.labels == IGNORE_INDEX, IGNORE_INDEX, e.labels % VOCAB).astype(np.int32)
    return out


# ---- the loader -------------------------------------------------------------------------------------------------
def test_padding_free_batches_hold_the_padded_samples_in_order_across_a_resume():
    exs = examples()
    padded = SFTLoader(exs, batch_size=3, seed=5)
    free = SFTLoader(exs, batch_size=3, seed=5, padding_free=True)
    for _ in range(5):  # 15 draws over 11 samples: crosses an epoch
        assert free.next_batch()["sample_ids"] == padded.next_batch()["sample_ids"]
    state = free.state_dict()
    assert state == {**padded.state_dict(), "padding_free": True}
    resumed = SFTLoader(exs, batch_size=3, seed=5, padding_free=True)
    resumed.load_state_dict(state)
    for _ in range(4):
        want = padded.next_batch()["sample_ids"]
        assert resumed.next_batch()["sample_ids"] == want
        assert free.next_batch()["sample_ids"] == want
    ev_p, ev_f = list(padded.iter_epoch()), list(free.iter_epoch())
    assert [b["sample_ids"] for b in ev_f] == [b["sample_ids"] for b in ev_p]
    assert all(b["input_ids"].shape[0] == 1 for b in ev_f)


def test_a_padding_free_batch_is_its_samples_end_to_end():
    exs = examples()
    chosen = [exs[4], exs[0], exs[7]]
    chosen[1].kl = True
    lengths = [len(e) for e in chosen]
    b = collate_padding_free(chosen, pad_id=0)
    N = sum(lengths)
    for key in ("input_ids", "labels", "doc_ids", "position_ids", "kl_mask"):
        assert tuple(b[key].shape) == (1, N), key  # no padding at all
    assert b["input_ids"][0].tolist() == np.concatenate([e.input_ids for e in chosen]).tolist()
    assert b["labels"][0].tolist() == np.concatenate([e.labels for e in chosen]).tolist()
    assert b["doc_ids"][0].tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
    assert b["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].device.type == "cpu"
    assert b["cu_seqlens"].tolist() == [0, *np.cumsum(lengths).tolist()]
    assert b["max_seqlen"] == max(lengths) and isinstance(b["max_seqlen"], int)
    assert b["kl_mask"][0].tolist() == [d == 1 for d, n in enumerate(lengths) for _ in range(n)]
    assert b["sample_ids"] == [e.line for e in chosen]
    chosen[1].kl = False


def test_counts_are_per_sample_and_real_tokens():
    exs = examples(3)
    exs[1].labels[:] = IGNORE_INDEX  # a sample with no loss token (e.g. a rank's dummy): counted as one
    padded, free = collate_padded(exs, 0), collate_padding_free(exs, 0)
    loss_tokens = sum(e.loss_tokens for e in exs)
    assert batch_counts(padded) == (loss_tokens, 1, padded["input_ids"].numel())
    assert batch_counts(free) == (loss_tokens, 1, sum(len(e) for e in exs))  # the real tokens, what the model saw


def test_the_loader_refuses_pack_and_buckets():
    with pytest.raises(InputError, match="--pack"):
        SFTLoader(examples(), 2, pack=True, max_seq_len=64, padding_free=True)
    with pytest.raises(InputError, match="--pad-buckets"):
        SFTLoader(examples(), 2, max_seq_len=64, buckets=(64,), padding_free=True)


# ---- the same loss and gradients --------------------------------------------------------------------------------
def lora_model() -> torch.nn.Module:
    model = tiny_causal_lm(tiny_config(), seed=3).float()
    model = apply_lora(model, 4, 8, seed=0)
    with torch.no_grad():  # B starts at 0: move it so the adapter's gradients reach A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    for p in model.parameters():  # base grads too: every weight the attention touches is compared
        p.requires_grad_(True)
    return model


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[float, int, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss, n, _ = CausalLMLoss().loss(model, batch, torch.device("cpu"))
    loss.backward()
    return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_padding_free_loss_and_gradients_equal_the_padded_batch():
    model = lora_model()
    exs = examples(5, seed=1)
    loss_p, n_p, grads_p = loss_and_grads(model, collate_padded(exs, 0))
    loss_f, n_f, grads_f = loss_and_grads(model, collate_padding_free(exs, 0))
    assert n_f == n_p
    assert abs(loss_f - loss_p) <= 1e-6 * abs(loss_p)
    assert grads_f.keys() == grads_p.keys() and any("lora_A" in k for k in grads_p)
    for k in grads_p:
        assert rel_l2(grads_f[k], grads_p[k]) <= 1e-5, k


def test_rows_padded_for_graphs_take_a_few_lengths_and_keep_the_samples_counts_and_loss():
    """With the step in CUDA graphs (SFTLoader.pad_rows_for_graphs) a padding-free row is padded to
    graph_row_length: 4 lengths per doubling, < 25% padding; the padding is a span of its own (labels -100) that
    batch_counts leaves out, and the loss and gradients are the exact row's."""
    lengths = {graph_row_length(n) for n in range(4097, 32769)}  # (4k, 32k]: 5k, 6k, 7k, 8k, 10k, ..., 32k
    assert len(lengths) == 12  # 3 doublings x 4
    for n in [1, 255, 256, 257, 1000, 4096, 4097, 11_800, 30_000, 65_536]:
        t = graph_row_length(n)
        assert n <= t < max(1.25 * n, n + 256) and t % 256 == 0, (n, t)  # short rows: a step of 256
    exs = examples(5, seed=1)
    exs[2].labels[:] = IGNORE_INDEX  # a sample without loss tokens stays counted as one
    exact, padded = collate_padding_free(exs, 0), collate_padding_free(exs, 0, graph_rows=64)
    n, T = exact["input_ids"].shape[1], padded["input_ids"].shape[1]
    assert T == graph_row_length(n) > n and padded["samples"] == len(exs)
    for key in ("input_ids", "labels", "doc_ids", "position_ids"):
        assert padded[key][:, :n].tolist() == exact[key].tolist(), key
    assert (padded["labels"][0, n:] == IGNORE_INDEX).all() and (padded["doc_ids"][0, n:] == -1).all()
    assert padded["cu_seqlens"].tolist() == [*exact["cu_seqlens"].tolist(), T]
    assert T >= padded["max_seqlen"] == min(T, max(64, T // 4, 256)) >= max(exact["max_seqlen"], T - n)
    for m in range(1, 70_000, 7):  # the padding span is never longer than the max_seqlen its row length gets
        t = graph_row_length(m)
        assert t - m <= min(t, max(t // 4, 256)), (m, t)
    assert batch_counts(padded) == batch_counts(exact) == (sum(e.loss_tokens for e in exs), 1, n)
    model = lora_model()
    loss_e, n_e, grads_e = loss_and_grads(model, exact)
    loss_p, n_p, grads_p = loss_and_grads(model, padded)
    assert n_p == n_e and abs(loss_p - loss_e) <= 1e-6 * abs(loss_e)
    for k in grads_e:
        assert rel_l2(grads_p[k], grads_e[k]) <= 1e-5, k
    loader = SFTLoader(exs, 3, seed=2, max_seq_len=64, padding_free=True)
    first = loader.next_batch()
    loader.pad_rows_for_graphs()
    second = loader.next_batch()
    assert "samples" not in first and second["input_ids"].shape[1] == graph_row_length(int(second["cu_seqlens"][3]))


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA and plain multi-head
def test_without_the_varlen_kernel_each_span_is_attended_alone(kv_heads, monkeypatch):
    """CPU / fp32: one causal SDPA per span, equal to the dense doc-id mask, and no N x N mask is ever built (16
    samples of 4k tokens would make one of 4 G entries)."""
    model = tiny_causal_lm(tiny_config(num_kv_heads=kv_heads), seed=3).float().eval()
    b = collate_padding_free(examples(4, seed=2), 0)
    with torch.no_grad():
        dense = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"])

    def no_dense(doc_ids):
        raise AssertionError("the padding-free fallback built the N x N doc-id mask")
    monkeypatch.setattr(varlen, "dense_doc_mask", no_dense)
    with torch.no_grad():
        spans = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"], cu_seqlens=b["cu_seqlens"],
                                    max_seqlen=b["max_seqlen"])
    assert rel_l2(spans, dense) <= 1e-6


# ---- the varlen adapter -----------------------------------------------------------------------------------------
def span_sdpa(q, k, v, cu, causal: bool):
    """What varlen attention computes: SDPA per span. q [T, H, D], k/v [T, H, D] (heads already matched)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for lo, hi in itertools.pairwise(bounds):
        y = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1),
                                           v[lo:hi].transpose(0, 1), is_causal=causal)
        out[lo:hi] = y.transpose(0, 1)
    return out


def fake_varlen(kind: str, calls: list):
    """A stand-in for torch's varlen_attn with one version's signature; it checks what it is given."""
    def check(q, k, v, cu_q, cu_k, max_q, max_k):
        assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0]  # [T, heads, D]
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert int(cu_q[-1]) == q.shape[0]

    def expand(q, k, v, gqa):
        if gqa:
            G = q.shape[1] // k.shape[1]
            return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        assert k.shape[1] == q.shape[1], "a varlen function without enable_gqa must get k/v repeated per head"
        return k, v

    if kind == "2.11":
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):
            check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
            calls.append(window_size)
            k, v = expand(query, key, value, False)
            return span_sdpa(query, k, v, cu_seq_q, tuple(window_size) == (-1, 0))
    elif kind == "2.13":
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
            calls.append((window_size, enable_gqa))
            assert enable_gqa == (key.shape[1] != query.shape[1])
            k, v = expand(query, key, value, enable_gqa)
            return span_sdpa(query, k, v, cu_seq_q, tuple(window_size) == (-1, 0))
    else:  # older: is_causal
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
            check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
            calls.append(is_causal)
            k, v = expand(query, key, value, False)
            return span_sdpa(query, k, v, cu_seq_q, is_causal)
    return fn


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA (4 heads over 2) and plain multi-head
@pytest.mark.parametrize("kind", ["2.11", "2.13", "is_causal"])
def test_varlen_adapter_equals_the_dense_doc_mask(kind, kv_heads, monkeypatch):
    calls: list = []
    model = tiny_causal_lm(tiny_config(num_kv_heads=kv_heads), seed=3).float().eval()
    b = collate_padding_free(examples(4, seed=2), 0)
    with torch.no_grad():
        dense = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"])
    monkeypatch.setattr(varlen, "varlen_function", lambda: fake_varlen(kind, calls))
    monkeypatch.setattr("entrenar.model.varlen_usable", lambda device, dtype: True)  # the CPU, fp32, for the test
    with torch.no_grad():
        spans = model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"], cu_seqlens=b["cu_seqlens"],
                                    max_seqlen=b["max_seqlen"])
    assert len(calls) == model.cfg.num_layers  # the varlen path ran in every block
    want = {"2.11": (-1, 0), "2.13": ((-1, 0), kv_heads != 4), "is_causal": True}[kind]
    assert all(c == want for c in calls), calls
    assert rel_l2(spans, dense) <= 1e-6


def test_verify_records_the_dense_attention_of_a_padding_free_row(monkeypatch):
    """record_internals (verify) needs the attention probabilities, which flash never builds: the dense mask runs."""
    calls: list = []
    model = tiny_causal_lm(tiny_config(), seed=3).float().eval()
    b = collate_padding_free(examples(3, seed=2), 0)
    monkeypatch.setattr(varlen, "varlen_function", lambda: fake_varlen("2.13", calls))
    monkeypatch.setattr("entrenar.model.varlen_usable", lambda device, dtype: True)
    with torch.no_grad(), model.record_internals({}) as trace:
        model.hidden_states(b["input_ids"], b["position_ids"], b["doc_ids"], cu_seqlens=b["cu_seqlens"],
                            max_seqlen=b["max_seqlen"])
    assert not calls
    probs = trace["layers.0.attn_probs"][0, 0]
    doc = b["doc_ids"][0]
    assert float(probs[doc[:, None] != doc[None, :]].abs().max()) == 0.0  # no attention across samples
    assert torch.allclose(probs.sum(-1), torch.ones(len(doc)))


def test_varlen_style_reads_each_signature():
    calls: list = []
    assert varlen.varlen_style(fake_varlen("2.11", calls)) == ("window_size", False)
    assert varlen.varlen_style(fake_varlen("2.13", calls)) == ("window_size", True)
    assert varlen.varlen_style(fake_varlen("is_causal", calls)) == ("is_causal", False)

    def no_causal(q, k, v, cu_q, cu_k, max_q, max_k):
        return q
    assert varlen.varlen_style(no_causal) == (None, False)

    class Unreadable:  # a callable whose signature cannot be read: how to ask for causal is unknown
        __signature__ = "not a signature"

        def __call__(self, *args):
            return args[0]
    assert varlen.varlen_style(Unreadable()) == (None, False)
    assert not varlen.varlen_usable(torch.device("cpu"), torch.bfloat16)  # the CPU: the dense mask
    assert not varlen.varlen_usable(torch.device("cuda"), torch.float32)  # fp32: flash cannot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention needs CUDA")
def test_cuda_varlen_loss_matches_the_padded_batch_bf16(monkeypatch):
    if not varlen.varlen_usable(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch has no usable varlen attention")
    model = tiny_causal_lm(tiny_config(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2), seed=3)
    model = model.to("cuda", torch.bfloat16)
    exs = examples(6, seed=4)
    attends = []
    real = varlen.VarlenSpans.attend
    monkeypatch.setattr(varlen.VarlenSpans, "attend", lambda self, q, k, v: attends.append(1) or real(self, q, k, v))
    device = torch.device("cuda")
    loss_p, n_p, _ = CausalLMLoss().loss(model, collate_padded(exs, 0), device)
    assert not attends
    loss_f, n_f, _ = CausalLMLoss().loss(model, collate_padding_free(exs, 0), device)
    assert len(attends) == model.cfg.num_layers and n_f == n_p
    loss_f.backward()  # the varlen kernel has a backward
    assert abs(float(loss_f) - float(loss_p)) <= 2e-2 * abs(float(loss_p))


# ---- the CLI ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    from tests.test_peft_seed import WORDS, tiny_base_and_data

    base, data = tiny_base_and_data(tmp_path_factory.mktemp("padfree"))
    # prompts of 1-3 sentences: batches of unequal rows, so the padded run pads
    rows = [{"prompt": " ".join([f"Say {w}."] * (1 + i % 3)), "completion": f"{w}!"} for i, w in enumerate(WORDS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, data


def finetune(base, data, out, *extra, capsys=None):
    return main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--batch-size", "3",
                 "--max-seq-len", "128", "--no-preflight", "--json", "--val-fraction", "0", *extra], capsys)


def step_losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r and r.get("kind", "train") == "train" and r.get("step", 0) > 0]


def test_cli_padding_free_losses_equal_the_padded_run(tmp_path, sft_base, capsys):
    base, data = sft_base
    code, run_p, err = finetune(base, data, tmp_path / "padded", "--steps", "4", capsys=capsys)
    assert code == 0, err
    code, run_f, err = finetune(base, data, tmp_path / "free", "--steps", "4", "--padding-free", capsys=capsys)
    assert code == 0, err
    assert run_f["tokens"] < run_p["tokens"]  # the padded run processed padding; the padding-free one none
    padded, free = step_losses(tmp_path / "padded"), step_losses(tmp_path / "free")
    assert len(padded) >= 4 and len(free) == len(padded)
    for a, b in zip(free, padded):
        assert abs(a - b) <= 1e-5 * abs(b), (free, padded)
    assert json.loads((tmp_path / "free" / "run.json").read_text())["data"]["padding_free"] is True


@pytest.mark.parametrize("extra, message", [
    (("--pack",), "choose one"),
    (("--pad-buckets", "2"), "drop --pad-buckets 2"),
    (("--objective", "dpo"), "--objective dpo"),
])
def test_cli_padding_free_refusals_exit_2(tmp_path, sft_base, capsys, extra, message):
    base, data = sft_base
    out = tmp_path / "run"
    code, result, err = finetune(base, data, out, "--steps", "1", "--padding-free", *extra, capsys=capsys)
    assert code == 2, err
    assert result is not None and result["exit_code"] == 2
    assert "--padding-free" in err and message in err
    assert not out.exists()


def test_padding_free_refusals_and_nothing_to_say_without_the_flag():
    check_padding_free(DataConfig(padding_free=True), "sft")
    check_padding_free(DataConfig(pack=True, pad_buckets=2), "dpo")  # without the flag: nothing to say
    with pytest.raises(InputError, match="choose one"):
        check_padding_free(DataConfig(padding_free=True, pack=True), "sft")


def rank_shares(exs: list, per_rank: int, world: int, epoch: bool = False) -> list[dict]:
    """Each rank's first batch (or its eval batches) from its own loader, as under torchrun (RankSlice)."""
    from entrenar.train.distributed import DistContext, RankSlice

    out = []
    for rank in range(world):
        ranked = RankSlice(SFTLoader(exs, per_rank, seed=5, padding_free=True), DistContext(rank=rank, world=world))
        out.append(list(ranked.iter_epoch()) if epoch else ranked.next_batch())
    return out


def test_torchrun_ranks_share_a_padding_free_batch_by_samples():
    """Under torchrun each rank takes its samples of the global padding-free batch as a padding-free batch of its
    own; together they are one process's batch of world x B samples: the same samples, counts and loss."""
    from entrenar.tensors import JOB_COUNTS

    exs, per_rank, world = examples(11, seed=6), 3, 2
    whole = SFTLoader(exs, per_rank * world, seed=5).next_batch()  # one process, padded, B x W samples
    shares = rank_shares(exs, per_rank, world)
    model = lora_model()
    total = 0.0
    for rank, share in enumerate(shares):
        mine = whole["sample_ids"][rank * per_rank:(rank + 1) * per_rank]
        want = collate_padding_free([next(e for e in exs if e.line == i) for i in mine], 0)
        assert share["sample_ids"] == mine and share["max_seqlen"] == want["max_seqlen"]
        for k in ("input_ids", "labels", "doc_ids", "position_ids", "cu_seqlens"):
            assert torch.equal(share[k], want[k]), k
        flat = collate_padding_free([next(e for e in exs if e.line == i) for i in whole["sample_ids"]], 0)
        assert share[JOB_COUNTS] == batch_counts(flat)  # every rank counts the whole step, no collective
        loss, _, _ = CausalLMLoss().loss(model, share, torch.device("cpu"))
        total += float(loss.detach())
    loss_whole, _, _ = CausalLMLoss().loss(model, whole, torch.device("cpu"))
    assert abs(total - float(loss_whole.detach())) <= 1e-6 * abs(float(loss_whole.detach()))


def test_a_rank_left_without_samples_runs_one_without_loss_tokens():
    """The last eval batch may leave a rank no sample: it runs the first sample with every label ignored (FSDP:
    every rank runs the forward), a padding-free batch of its own."""
    exs = examples(7, seed=6)  # batches of 2 x 3: 6, then 1 sample
    last = [batches[-1] for batches in rank_shares(exs, 3, 2, epoch=True)]
    assert last[0]["sample_ids"] == [exs[6].line] and last[1]["sample_ids"] == []
    idle = last[1]
    n = len(exs[6])  # the global batch's first (and only) sample, with no loss token
    assert bool((idle["labels"] == IGNORE_INDEX).all()) and idle["input_ids"].shape == (1, n)
    assert idle["cu_seqlens"].tolist() == [0, n] and idle["max_seqlen"] == n
    assert torch.equal(idle["input_ids"], last[0]["input_ids"])


def test_config_file_and_api_take_padding_free(tmp_path, sft_base):
    import entrenar

    base, data = sft_base
    config = tmp_path / "run.yaml"
    config.write_text("padding_free: true\npad_buckets: 2\n")
    with pytest.raises(InputError, match="drop --pad-buckets 2"):
        entrenar.finetune(config=config, model=str(base), data=str(data), out=str(tmp_path / "run"), steps=1)
    with pytest.raises(InputError, match="choose one"):
        entrenar.finetune(model=str(base), data=str(data), out=str(tmp_path / "run"), steps=1, padding_free=True,
                          pack=True)
    assert not (tmp_path / "run").exists()
