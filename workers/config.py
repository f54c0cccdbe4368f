"""The run config: one cell of a sweep, exactly what a gang of rank actors runs.

The same pydantic model validates API requests, CLI files and what workers receive; the
sweep spec (service/) expands into a list of these.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Dtype = Literal["float32", "float16", "bfloat16"]
Mode = Literal["forward", "train"]
Parallel = Literal["sequence", "data"]
Device = Literal["auto", "cuda", "cpu"]
Placement = Literal["pack", "spread", "strict_spread"]


class SearchConfig(BaseModel):
    """Maximum sequence length search: double from `start` to the first OOM, then bisect."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(1024, ge=1, description="First length tried.")
    max: int = Field(1 << 24, ge=1, description="Never probe beyond this length.")
    granularity: int = Field(1024, ge=1, description="Bisection stops at this resolution.")
    fresh_processes: bool = Field(
        False,
        description="Run each probe in fresh actors: an OOM's fragmentation cannot bias the next.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SearchConfig:
        if self.max < self.start:
            raise ValueError(f"max ({self.max}) must be >= start ({self.start})")
        return self


class RunConfig(BaseModel):
    """Everything one run needs: kernel and shape, precision, parallelism, protocol, placement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kernel: str = Field(description="A name from attention.KERNELS.")
    params: dict[str, Any] = Field(default_factory=dict, description="The kernel's parameters.")
    seq_len: int = Field(ge=1, description="Total tokens per sequence (across all ranks).")
    batch_size: int = Field(1, ge=1)
    num_heads: int = Field(8, ge=1)
    head_dim: int = Field(64, ge=1)
    dtype: Dtype = "float32"
    causal: bool = False
    mode: Mode = "forward"
    world_size: int = Field(1, ge=1, le=4096)
    parallel: Parallel = "sequence"
    device: Device = "auto"
    memory_budget_bytes: int | None = Field(None, ge=1)
    warmup: int = Field(2, ge=0)
    iterations: int = Field(5, ge=1)
    timeout_s: float = Field(600.0, gt=0)
    dist_timeout_s: float = Field(
        120.0, gt=0, description="torch.distributed init/collective timeout."
    )
    max_attempts: int = Field(1, ge=1, le=10)
    placement: Placement = "pack"
    fresh_processes: bool = False
    correctness_check: bool = False
    seed: int = Field(
        0,
        ge=0,
        le=2**30 - 1,
        description="Seeds the inputs of every rank, and a layer kernel's weights (multihead).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="NCCL_* variables for the ranks.")
    search: SearchConfig | None = None

    @field_validator("env")
    @classmethod
    def _only_nccl(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in value if not k.startswith("NCCL_"))
        if bad:
            raise ValueError(f"only NCCL_* variables pass through, got {', '.join(bad)}")
        return value

    @model_validator(mode="after")
    def _kernel_fits(self) -> RunConfig:
        import attention

        if self.parallel == "data":
            spec = attention.KERNELS.get(self.kernel)
            if spec is not None and spec.distributed:
                raise ValueError(
                    f"parallel=data runs a single-process kernel on each rank; {self.kernel!r} "
                    "is a ring kernel (use parallel=sequence)"
                )
            if self.batch_size % self.world_size:
                raise ValueError(
                    f"parallel=data splits the batch: batch_size ({self.batch_size}) must divide "
                    f"by world_size ({self.world_size})"
                )
            shard_world = 1
        else:
            shard_world = self.world_size
        # A layer kernel's embed_dim / num_heads come from this cell's num_heads x head_dim;
        # params that contradict them are refused here (`params.embed_dim: ...`).
        params = attention.shape_params(
            self.kernel, self.params, num_heads=self.num_heads, head_dim=self.head_dim
        )
        attention.validate(
            self.kernel,
            params,
            seq_len=self.seq_len,
            world_size=shard_world,
            num_heads=self.num_heads,
            causal=self.causal,
        )
        return self

    @property
    def local_batch(self) -> int:
        """Batch rows each rank holds."""
        return self.batch_size // self.world_size if self.parallel == "data" else self.batch_size

    @property
    def local_seq_len(self) -> int:
        """Tokens each rank holds."""
        return self.seq_len // self.world_size if self.parallel == "sequence" else self.seq_len
