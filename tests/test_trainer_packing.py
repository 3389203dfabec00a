"""Packing: budgets, rank splits, and that a packed row gives the same log-probs (and gradients) as
each sequence run on its own, so attention never crosses sequences."""

import random

import torch

from pipelinerl.trainer.packing import Sample, pack, padding_micro_batch


def split_among_ranks(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Test helper: balance tokens over ranks (longest first onto the least-loaded rank)."""
    shares: list[list[Sample]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for s in sorted(samples, key=lambda s: -s.num_tokens):
        r = min(range(world_size), key=lambda i: (load[i], i))
        shares[r].append(s)
        load[r] += s.num_tokens
    return [sorted(share, key=lambda s: s.index) for share in shares]


def make_samples(n, seed=0, vocab=17):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        out.append(Sample(p, c, index=i, token_fields={"t": [float(k) for k in range(len(c))]},
                          seq_fields={"adv": float(i)}))
    return out


def test_pack_fills_rows_within_budget_and_keeps_every_token():
    samples = make_samples(20)
    rows = pack(samples, micro_batch_tokens=24)
    assert all(r.num_tokens <= 24 for r in rows)
    assert sum(r.num_sequences for r in rows) == 20
    # first-fit decreasing wastes less than one row's worth of budget here
    assert len(rows) <= sum(s.num_tokens for s in samples) // 24 + 1
    seen = sorted(i for r in rows for i in r.seq_index_N.unique().tolist())
    assert seen == list(range(20))
    for r in rows:
        ids, pos = r.input_ids[0], r.position_ids[0]
        for k, t in enumerate(r.target_pos_N.tolist()):
            s = samples[int(r.seq_index_N[k])]
            assert pos[t] >= len(s.prompt_ids)  # targets are completion tokens of their own sequence
            assert ids[t] == s.completion_ids[pos[t] - len(s.prompt_ids)]
            assert r.fields_N["t"][k] == pos[t] - len(s.prompt_ids)  # per-token fields follow their tokens
            assert r.seq_fields_S["adv"][r.row_seq_N[k]] == float(s.index)  # per-sequence ones, once per sequence
        assert r.seq_fields_S["adv"].numel() == r.num_sequences
        starts = (pos == 0).sum().item()
        assert starts == r.num_sequences


def test_a_sample_longer_than_the_budget_gets_its_own_row():
    long = Sample([3] * 10, [4] * 10, index=0)
    short = Sample([3], [4], index=1)
    rows = pack([short, long], micro_batch_tokens=8)
    assert sorted(r.num_tokens for r in rows) == [2, 20]


def test_split_among_ranks_balances_tokens_and_is_a_partition():
    samples = make_samples(33, seed=1)
    shares = split_among_ranks(samples, 4)
    assert sorted(s.index for share in shares for s in share) == list(range(33))
    loads = [sum(s.num_tokens for s in share) for share in shares]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in samples)
    assert shares == split_among_ranks(samples, 4)  # every rank computes the same split


def _per_sequence_logprobs(model, samples):
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logp = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
        pos = torch.arange(len(s.prompt_ids), ids.shape[1])
        out.append(logp[pos - 1, ids[0, pos]])
    return out


def test_packed_forward_equals_per_sequence_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import completion_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    samples = make_samples(7, seed=2)
    (row,) = pack(samples, micro_batch_tokens=10_000)
    packed_N = completion_logprobs(model, row, torch.device("cpu"))
    refs = _per_sequence_logprobs(model, samples)
    for s, ref in zip(samples, refs):
        got = packed_N[row.seq_index_N == s.index]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the same for gradients: a packed loss and the per-sequence losses agree
    packed_N.sum().backward()
    packed_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.stack([r.sum() for r in _per_sequence_logprobs(model, samples)]).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grad[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_packing_is_not_detected_by_accident(tiny_model_dir):
    """Without position-id restarts the same row would leak attention: the test above is not vacuous."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    samples = make_samples(3, seed=3)
    (row,) = pack(samples, micro_batch_tokens=10_000)
    leaky = type(row)(**{**row.__dict__, "position_ids": torch.arange(row.num_tokens)[None]})
    refs = torch.cat(_per_sequence_logprobs(model, sorted(samples, key=lambda s: -s.num_tokens)))
    got = completion_logprobs(model, leaky, torch.device("cpu"))
    assert not torch.allclose(got, refs, atol=1e-4)


def test_padding_micro_batch_has_one_target_and_no_sequences():
    mb = padding_micro_batch(["t"], ["adv"])
    assert mb.is_padding and mb.num_sequences == 0 and mb.target_pos_N.tolist() == [1]
    assert mb.fields_N["t"].tolist() == [0.0] and mb.seq_fields_S["adv"][mb.row_seq_N].tolist() == [0.0]


def test_samples_packed_together_share_a_row_and_the_rest_still_fills_rows():
    samples = make_samples(24, seed=3)
    keys = [i // 3 if i % 3 < 2 else None for i in range(24)]  # pairs (0,1), (3,4), ... must stay together
    rows = pack(samples, micro_batch_tokens=24, together=keys)
    row_of = {int(i): r for r, row in enumerate(rows) for i in row.seq_index_N.unique()}
    for i in range(0, 24, 3):
        assert row_of[i] == row_of[i + 1], f"pair {i},{i + 1} split over rows"
    assert sorted(row_of) == list(range(24))
    pair_tokens = [samples[i].num_tokens + samples[i + 1].num_tokens for i in range(0, 24, 3)]
    assert all(r.num_tokens <= max(24, max(pair_tokens)) for r in rows)
    assert len(rows) <= sum(s.num_tokens for s in samples) // 24 + 2


def test_a_bundle_longer_than_the_budget_gets_its_own_row():
    a, b, c = Sample([3] * 5, [4] * 5, index=0), Sample([3] * 5, [4] * 5, index=1), Sample([3], [4], index=2)
    rows = pack([a, c, b], micro_batch_tokens=12, together=["g", None, "g"])
    assert sorted(r.num_tokens for r in rows) == [2, 20]
    assert sorted(rows[0].seq_index_N.unique().tolist()) == [0, 1]
