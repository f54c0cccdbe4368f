"""Exact and sparse attention kernels for long contexts, built on one (out, lse) primitive.

Imports only torch and the standard library. `build(name, **params)` makes a kernel,
`KERNELS` lists them with their parameter schemas, `validate(...)` checks a shape fits one,
`shape_params(...)` sets a layer kernel's embed_dim / num_heads from a run's shape.
"""

# importing a kernel module registers it
from attention import block_sparse, dense, dilated, multihead, ring  # noqa: F401
from attention.registry import KERNELS, KernelSpec, build, make_params, shape_params, validate

__all__ = ["KERNELS", "KernelSpec", "build", "make_params", "shape_params", "validate"]
