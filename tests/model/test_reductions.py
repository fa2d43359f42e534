"""The chunked argmax and top-k give torch's answers, ties and odd shapes included."""

import pytest
import torch

from tokenloom.model.reductions import CHUNK, row_argmax, row_topk_indices


@pytest.mark.parametrize("vocab", [CHUNK * 96, CHUNK * 4, CHUNK * 4 + 3, 100])
def test_row_argmax_is_torchs_first_maximum(vocab):
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
def test_row_topk_indices_hold_torchs_top_values(vocab, k):
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(64, vocab, generator=generator)
    x[0, :k] = 100.0 + torch.arange(k)  # all of the top values in one chunk
    x[1, torch.arange(k) * CHUNK] = 50.0  # one in each of k chunks
    ours = row_topk_indices(x, k)
    assert ours.shape == (64, k)
    assert torch.equal(x.gather(1, ours).sort(dim=-1).values, x.topk(k, dim=-1).values.sort(dim=-1).values)
    assert torch.equal(ours[0].sort().values, torch.arange(k))
