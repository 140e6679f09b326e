"""The reference causal attention under torch.compile (inductor), as ``trainer.compile`` runs it: the padded
length is read from the offsets inside the graph (a data-dependent size), and the result equals eager's."""

import pytest
import torch

from kernels.causal_attention import causal_attention
from kernels.types import Jagged


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return causal_attention(Jagged(q, offsets), Jagged(k, offsets), Jagged(v, offsets), backend="reference",
                            validate=False).values


def test_inductor_compiles_the_reference_with_a_data_dependent_length():
    import torch._dynamo

    from trainer.distributed import capture_data_dependent_sizes

    capture_data_dependent_sizes()
    torch._dynamo.reset()
    compiled = torch.compile(_attend, backend="inductor", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    # Inductor's batched matmul asked whether the padded length is 1 and failed on real batches (2026-12-04).
    for lengths in ([0, 1, 16, 17, 0, 33], [1, 1, 0, 1], [4, 0, 2]):
        q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(3))
        offsets = Jagged.from_lengths(q, lengths).offsets
        torch.testing.assert_close(compiled(q, k, v, offsets), _attend(q, k, v, offsets), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1, 1, 0, 1], [0, 0]])
def test_padding_to_two_slots_changes_no_output(lengths):
    """A batch whose longest row has 0 or 1 tokens: each token attends only itself (its own v)."""
    q, k, v = (torch.randn(sum(lengths), 2, 4) for _ in range(3))
    torch.testing.assert_close(_attend(q, k, v, Jagged.from_lengths(q, lengths).offsets), v)
