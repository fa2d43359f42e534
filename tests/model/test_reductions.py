"""Row argmax and top-k give torch's answers, ties and odd shapes included: through tokenloom::row_topk where the
C++ operators are built, and through the chunked torch path (other devices and dtypes)."""

import pytest
import torch
from helpers import needs_operator

from tokenloom.model import cpu_kernel
from tokenloom.model.reductions import CHUNK, row_argmax, row_topk_indices


@pytest.fixture(params=["operator", "chunked"])
def path(request, monkeypatch):
    if request.param == "operator":
        needs_operator()
        assert cpu_kernel.has_row_topk()
    else:
        monkeypatch.setattr(cpu_kernel, "has_row_topk", lambda: False)
    return request.param


@pytest.mark.parametrize("vocab", [CHUNK * 96, CHUNK * 4, CHUNK * 4 + 3, 100])
def test_row_argmax_is_torchs_first_maximum(vocab, path):
    generator = torch.Generator().manual_seed(vocab)
    # Small integers: many ties, so "the first maximum" is tested, not just "a maximum".
    x = torch.randint(-50, 50, (64, vocab), generator=generator).float()
    x[3, -1] = 1000.0  # the maximum in the last chunk
    x[5, 0] = 1000.0  # and in the first
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    bf16 = torch.randn(8, vocab, generator=generator).to(torch.bfloat16)
    assert torch.equal(row_argmax(bf16), bf16.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [CHUNK * 96, CHUNK * 8 + 1])
@pytest.mark.parametrize("k", [1, 8])
def test_row_topk_indices_hold_torchs_top_values(vocab, k, path):
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(64, vocab, generator=generator)
    x[0, :k] = 100.0 + torch.arange(k)  # all of the top values in one chunk
    x[1, torch.arange(k) * CHUNK] = 50.0  # one in each of k chunks
    ours = row_topk_indices(x, k)
    assert ours.shape == (64, k)
    assert torch.equal(x.gather(1, ours).sort(dim=-1).values, x.topk(k, dim=-1).values.sort(dim=-1).values)
    assert torch.equal(ours[0].sort().values, torch.arange(k))


@pytest.mark.parametrize(
    ("n", "k"),
    [(n, k) for n in (1, 5, 16, 17, 33, 100, 49152) for k in (1, 3, 8, 64) if k <= n],  # k: at most the width
)
def test_the_operator_keeps_the_largest_first_and_the_first_of_equals(n, k):
    needs_operator()
    generator = torch.Generator().manual_seed(n * 100 + k)
    x = torch.randint(-20, 20, (5, n), generator=generator).float()  # ties everywhere
    x[1] = float("-inf")  # every token masked: still k indices, the first k
    x[2, n // 2] = float("nan")  # ranks below every other value
    x[3, n - 1] = 1e9  # the largest as the very last value
    wide = torch.zeros(5, n + 7)
    wide[:, :n] = x
    for rows in (x, wide[:, :n]):  # contiguous, and rows with a stride
        ours = torch.ops.tokenloom.row_topk(rows, k)
        for r in (0, 1, 3, 4):
            values = x[r]
            # Largest first; among equal values the earlier index first: a stable sort, descending.
            expected = torch.tensor(sorted(range(n), key=lambda i: -values[i].item())[:k])
            assert torch.equal(ours[r], expected), (r, ours[r], expected)
        if n > k:  # k values besides the NaN: it is not among the chosen
            assert not torch.isnan(x[2, ours[2]]).any()


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_refine_top_logits_recomputes_each_rows_top_k_from_the_head_and_leaves_the_rest(head_dtype, rows):
    """refine_top_logits (CausalLM.compute_logits' last step on a CPU): each row's k largest approximate logits are
    replaced by normed . head[token] in float32, every other logit is left as it was."""
    needs_operator()
    generator = torch.Generator().manual_seed(rows)
    vocab, hidden, k = 1000, 96, 8
    normed = torch.randn(rows, hidden, generator=generator)
    head = torch.randn(vocab, hidden, generator=generator).to(head_dtype)
    exact = normed @ head.float().T
    approximate = exact + 0.05 * torch.randn(rows, vocab, generator=generator)  # a coarser head's logits
    top = approximate.topk(k).indices
    logits = approximate.clone()
    torch.ops.tokenloom.refine_top_logits(logits, normed, head, k)
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top))
    untouched = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(logits[untouched], approximate[untouched])
    with pytest.raises(RuntimeError, match="head must be float32 or bfloat16"):
        torch.ops.tokenloom.refine_top_logits(logits, normed, head[:, :10], k)
