"""Ring attention across ranks: K/V travel a ring of ranks; one file per variant."""

# importing a variant module registers it
from attention.ring import allgather, block_sparse, dense, dilated, ulysses, usp  # noqa: F401
