"""The CPU kernel's one-pass race (engine/csrc/sample_cpu.cpp) against its definition: Philox4x32-10's
stream (checked against the generator's published known answers), and the token with the largest
l / T - log(-log(u)) computed in float64. tests/engine/test_cpu_isa.py runs `check_race` in the AVX2
build as well; tests/engine/test_sampling.py runs the sampler with and without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = np.uint64(0xFFFFFFFF)
# Random123's known answers for philox4x32_10: (counter words, key words) -> output words
KNOWN = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


def philox4x32(counter, key) -> list[np.ndarray]:
    """Philox4x32-10 of counter words (each a number or an array of them) under two key words."""
    c = [np.asarray(x, dtype=np.uint64) for x in counter]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(W0)) & MASK, (k1 + np.uint64(W1)) & MASK
        p0, p1 = c[0] * np.uint64(M0), c[2] * np.uint64(M1)
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & MASK, p1 & MASK, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & MASK, p0 & MASK]
    return c


def uniforms(key: int, counter: int, n: int) -> np.ndarray:
    """The n uniforms the race reads for (key, counter): token i is word i % 4 of block i // 4, the
    block's counter words (i // 4, 0, counter low, counter high), its top 24 bits over 2^24."""
    key, counter = key % 2**64, counter % 2**64
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    words = philox4x32([blocks, 0, counter & 0xFFFFFFFF, counter >> 32], [key & 0xFFFFFFFF, key >> 32])
    return (np.stack(words, axis=1).reshape(-1)[:n] >> np.uint64(8)).astype(np.float64) / 2**24


def kept(s: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """What top-p and min-p keep of a row of scaled logits s (float32), by their definitions: top-p the
    tokens ranked (by s, ties by index) before the probability mass reaches top_p, that one included;
    min-p those with s >= max s + log(min_p) (in float32, as the kernel compares)."""
    keep = np.ones(len(s), dtype=bool)
    m = s.max()
    if min_p > 0:
        keep &= s >= np.float32(m) + np.float32(np.log(np.float32(min_p)))
    if top_p < 1:
        order = np.lexsort((np.arange(len(s)), -s.astype(np.float64)))
        p = np.exp(s[order].astype(np.float64) - m)
        before = np.cumsum(p) - p
        keep[order[before >= top_p * p.sum()]] = False
    return keep


def check_race(ops) -> int:
    """The kernel's tokens against the float64 definition, for every logits dtype, rows greedy and
    sampled, with and without top-p and min-p, a vocabulary that ends inside a register and inside a
    chunk, masked tokens, bfloat16's ties at a top-p boundary; returns the rows compared (those whose
    two best scores are apart by more than float32 rounding)."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 18, 9000 + 5
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([3.0, 1.0, 8.0] * 6)[:, None]
    logits[3, ::2] = float("-inf")  # a grammar's mask
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 2.0, 0.25] * 3)
    top_p = torch.tensor([1.0] * 6 + [0.9, 0.5, 0.95, 1.0, 0.3, 0.99] + [0.8, 1.0, 0.7, 0.9, 0.97, 0.6])
    min_p = torch.tensor([0.0] * 6 + [0.0] * 6 + [0.05, 0.1, 0.0, 0.2, 0.01, 0.3])
    keys = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    counters = torch.tensor([0, 1, 2, -(2**63), -(2**63) + 5, 2**40] * 3)
    compared = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        tokens = ops.sample_race(x, temperature, top_p, min_p, keys, counters).tolist()
        for r in range(rows):
            if temperature[r] <= 0:  # greedy: the first largest, as torch.argmax
                assert tokens[r] == int(x[r].float().argmax()), (dtype, r)
                continue
            s = (x[r].float() * (1.0 / temperature[r].item())).numpy()  # float32 products, as the kernel's
            with np.errstate(divide="ignore", invalid="ignore"):
                score = s.astype(np.float64) - np.log(-np.log(uniforms(int(keys[r]), int(counters[r]), vocab)))
            score = np.where(np.isnan(score) | ~kept(s, float(top_p[r]), float(min_p[r])), -np.inf, score)
            first, second = np.sort(score)[-2:][::-1]
            if first - second > 1e-4 * max(1.0, abs(first)):
                assert tokens[r] == int(np.argmax(score)), (dtype, r, tokens[r], int(np.argmax(score)))
                compared += 1
    return compared


@pytest.fixture(scope="module")
def ops():
    from engine.backends.cpu_kernels import cpu_ops

    ops = cpu_ops()
    assert ops is not None, "the C++ kernels must build here"
    return ops


def test_the_reference_generator_gives_philoxs_known_answers() -> None:
    for counter, key, want in KNOWN:
        assert [int(w) for w in philox4x32(counter, key)] == list(want)


def test_the_kernels_uniforms_are_philoxs_stream(ops) -> None:
    assert ops.race_uniforms(0, 0, 4).tolist() == [(w >> 8) / 2**24 for w in KNOWN[0][2]]
    for key, counter, n in [(0, 0, 10), (12345, 7, 1000), (-1, -5, 9157), (2**62 + 3, 2**40 + 1, 333), (5, -(2**63), 64)]:
        assert np.array_equal(ops.race_uniforms(key, counter, n).double().numpy(), uniforms(key, counter, n))


def test_the_kernels_tokens_are_the_races_winners(ops) -> None:
    assert check_race(ops) >= 30


@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (0.5, 0.0), (1.0, 0.2), (0.8, 0.05), (0.999, 0.0)])
def test_top_p_and_min_p_keep_what_their_definitions_keep(ops, top_p, min_p) -> None:
    """The tokens drawn, over many counters, are all kept by the definition, each at its renormalised
    probability (bfloat16 logits: ties at the boundary; a scale of 2: a nucleus of tens of tokens)."""
    g = torch.Generator().manual_seed(5)
    row = (torch.randn(1, 400, generator=g) * 2).bfloat16()
    n = 4000
    tokens = ops.sample_race(row.repeat(n, 1), torch.ones(n), torch.full((n,), top_p), torch.full((n,), min_p),
                             torch.full((n,), 3), torch.arange(n))  # fmt: skip
    keep = kept(row[0].float().numpy(), top_p, min_p)
    drawn = np.bincount(tokens.numpy(), minlength=400)
    assert not drawn[~keep].any()
    p = np.where(keep, np.exp(row[0].double().numpy() - row[0].double().numpy().max()), 0.0)
    p /= p.sum()
    assert np.abs(drawn / n - p).max() < 0.03, (drawn / n, p)


def test_the_race_does_not_depend_on_the_threads_or_the_other_rows(ops) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50000, generator=g).bfloat16()
    temperature, keys, counters = torch.ones(6), torch.arange(6) * 11, torch.arange(6)
    top_p, min_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 1.0]), torch.tensor([0.0, 0.0, 0.1, 0.0, 0.02, 0.0])
    together = ops.sample_race(logits, temperature, top_p, min_p, keys, counters)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [int(ops.sample_race(logits[r : r + 1], temperature[r : r + 1], top_p[r : r + 1], min_p[r : r + 1],
                                     keys[r : r + 1], counters[r : r + 1])) for r in range(6)]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert together.tolist() == alone


def test_sampled_frequencies_are_softmaxs(ops) -> None:
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, float("-inf")])
    for t in (1.0, 0.5):
        n = 20000
        tokens = ops.sample_race(logits.repeat(n, 1), torch.full((n,), t), torch.ones(n), torch.zeros(n),
                                 torch.full((n,), 99), torch.arange(n))  # fmt: skip
        freq = torch.bincount(tokens, minlength=6).double() / n
        assert freq[5] == 0
        assert (freq - torch.softmax(logits.double() / t, -1)).abs().max() < 0.015, freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_logsumexp_is_torchs(ops, dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 49157, generator=g) * 4).to(dtype)
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")  # nothing finite: -inf, as torch
    x[3, :7] = 30.0
    out = ops.logsumexp_rows(x)
    want = torch.logsumexp(x.float(), dim=-1)
    assert out.dtype == torch.float32 and out[2] == float("-inf")
    assert torch.allclose(out[[0, 1, 3, 4]], want[[0, 1, 3, 4]], rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.logsumexp_rows(torch.zeros(8, 1, 2)[:, :, 0].t())


def test_a_row_of_ties_is_greedys_first_and_refusals_are_clear(ops) -> None:
    ties = torch.zeros(2, 100, dtype=torch.bfloat16)
    ties[:, [17, 40, 90]] = 1.0
    two = (torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert ops.sample_race(ties, *two).tolist() == [17, 17]
    one = (torch.zeros(1), torch.ones(1), torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.sample_race(torch.zeros(1, 8, dtype=torch.float64), *one)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.sample_race(torch.zeros(8, 1, 2)[:, :, 0].t(), *one)
    with pytest.raises(RuntimeError, match="one temperature, top_p, min_p, key and counter a row"):
        ops.sample_race(torch.zeros(2, 8), *one)
    with pytest.raises(RuntimeError, match="temperature, top_p and min_p float32"):
        ops.sample_race(torch.zeros(1, 8), torch.zeros(1, dtype=torch.float64), *one[1:])
