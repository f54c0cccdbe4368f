"""Exact and sparse attention kernels for long contexts, built on one (out, lse) primitive.

Imports only torch and the standard library. `build(name, **params)` makes a kernel,
installed packages add kernels through the entry points `ringlab.kernels` (attention.plugins,
docs/plugins.md; `Kernel`, `KernelSpec`, `attention_flops` are what a plugin builds on),
`KERNELS` lists them with their parameter schemas, `validate(...)` checks a shape fits one,
`shape_params(...)` sets a layer kernel's embed_dim / num_heads from a run's shape; every fact
about a kernel (its twin, reference, layout rule, communication overlap, bench grid) is a field
of its KernelSpec, the one declaration the service, workers and bench read (docs/kernels.md).
"""

# importing a kernel module registers it
from attention import block_sparse, dense, dilated, multihead, plugins, ring  # noqa: F401
from attention.base import ExactKernel, Kernel, attention_flops, causal_pairs
from attention.errors import ParamError
from attention.registry import (
    KERNELS,
    RING_PARAMS,
    UNAVAILABLE,
    BenchParams,
    CommOverlap,
    Exact,
    KernelSpec,
    build,
    check_cuda_head_dim,
    check_parallel,
    exact_dense,
    make_params,
    shape_params,
    structural_periods,
    twin_of,
    twin_params,
    validate,
)

__all__ = [
    "KERNELS",
    "RING_PARAMS",
    "UNAVAILABLE",
    "BenchParams",
    "CommOverlap",
    "Exact",
    "ExactKernel",
    "Kernel",
    "KernelSpec",
    "ParamError",
    "attention_flops",
    "build",
    "causal_pairs",
    "check_cuda_head_dim",
    "check_parallel",
    "exact_dense",
    "make_params",
    "shape_params",
    "structural_periods",
    "twin_of",
    "twin_params",
    "validate",
]

plugins.load()  # the installed packages' kernels (entry points `ringlab.kernels`), last
