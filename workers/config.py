"""The run config: one cell of a sweep, exactly what a gang of rank actors runs.

The same pydantic model validates API requests, CLI files and what workers receive; the
sweep spec (service/) expands into a list of these.
"""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import attention
from attention.errors import ParamError

Dtype = Literal["float32", "float16", "bfloat16"]
Mode = Literal["forward", "train"]
Parallel = Literal["sequence", "data"]
Device = Literal["auto", "cuda", "cpu"]
Placement = Literal["pack", "spread", "strict_spread"]
Isolation = Literal["gpu", "node"]
Workload = Literal["attention", "model"]
Optimizer = Literal["adamw", "sgd", "adamw8bit"]
Precision = Literal["fp32", "bf16_autocast", "fp16_autocast", "bf16"]
Checkpointing = Literal["none", "blocks", "attention", "every_k"]

PRECISION_DTYPES: dict[str, Dtype] = {
    "fp32": "float32",
    "bf16_autocast": "bfloat16",
    "fp16_autocast": "float16",
    "bf16": "bfloat16",
}
"""The dtype the attention kernel computes in under each training precision."""


MAX_ENV_VARS = 32
MAX_ENV_CHARS = 256
"""NCCL_* names and values are short; a cap keeps one request from writing megabytes into
every run of a sweep (each run stores its whole config)."""
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
"""A portable environment variable name (POSIX's portable set, upper case as NCCL's are)."""
ENV_VALUE_FORBIDDEN = ("\0", "\n", "\r")
"""Characters no environment value may hold (NUL ends a C string; line breaks split env files)."""
MAX_PARAMS_CHARS = 4096
"""A kernel's parameters as JSON (the longest real ones, LongNet's lists, are ~150)."""


class ModelConfig(BaseModel):
    """A GPT-style decoder: pre-norm blocks, rotary positions (no learned position table),
    GELU MLP, LM head tied to the embedding or not. Its attention is the run's kernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(
        None, max_length=40, description="A label for reports (e.g. 125M); changes nothing."
    )
    d_model: int = Field(ge=8, le=65536)
    n_layers: int = Field(ge=1, le=1024)
    n_heads: int = Field(ge=1, le=1024)
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); default n_heads."
    )
    ffn_multiplier: float = Field(4.0, gt=0, le=64, description="MLP width / d_model.")
    vocab_size: int = Field(50304, ge=2, le=1 << 24)
    tied_embeddings: bool = Field(True, description="The LM head reuses the embedding matrix.")

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ParamError(
                "d_model", f"{self.d_model} must be divisible by n_heads {self.n_heads} (head_dim)"
            )
        if self.head_dim % 2:
            raise ParamError(
                "d_model",
                f"head_dim = d_model / n_heads = {self.head_dim} must be even "
                "(rotary positions rotate pairs of dimensions)",
            )
        kv = self.kv_heads
        if kv > self.n_heads or self.n_heads % kv:
            raise ParamError(
                "num_kv_heads",
                f"{kv} must divide n_heads {self.n_heads} (each key/value head "
                "serves an equal group of query heads)",
            )
        return self

    @property
    def head_dim(self) -> int:
        """d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """num_kv_heads, or n_heads when unset (plain multi-head attention)."""
        return self.num_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width: round(ffn_multiplier x d_model)."""
        return max(1, round(self.ffn_multiplier * self.d_model))


class TrainingConfig(BaseModel):
    """How a model cell trains: optimizer, precision, activation checkpointing, chunked loss.

    A model run takes a first step (its optimizer states measured), then the run's `warmup`
    steps (the first measured phase by phase), then `iterations` timed steps: the step count
    is 1 + the run's own warmup (at least 1) + iterations.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Optimizer = Field(
        "adamw", description="adamw (fused), sgd (momentum 0.9), adamw8bit (bitsandbytes, CUDA)."
    )
    precision: Precision = Field(
        "fp32",
        description="fp32; bf16_autocast / fp16_autocast (fp32 weights, fp16 with a grad "
        "scaler); bf16: weights, gradients and optimizer states in bfloat16.",
    )
    checkpointing: Checkpointing = Field(
        "none",
        description="none; blocks: every block recomputed in backward; attention: only the "
        "attention sublayer; every_k: every checkpoint_every-th block.",
    )
    checkpoint_every: int | None = Field(
        None, ge=1, description="k for checkpointing every_k (blocks 0, k, 2k, ...)."
    )
    loss_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Compute the LM head and loss over chunks of this many tokens, each "
        "recomputed in backward, so the (tokens x vocab) logits never exist at once.",
    )
    lr: float = Field(1e-4, gt=0, le=10)

    @model_validator(mode="after")
    def _every_k(self) -> TrainingConfig:
        if self.checkpointing == "every_k" and self.checkpoint_every is None:
            raise ValueError("checkpoint_every: checkpointing every_k needs checkpoint_every")
        if self.checkpointing != "every_k" and self.checkpoint_every is not None:
            raise ParamError(
                "checkpoint_every", f"only for checkpointing every_k, not {self.checkpointing}"
            )
        return self


class SearchConfig(BaseModel):
    """Maximum sequence length search: double from `start` to the first OOM, then narrow the
    bracket to `granularity` (towards the length the measured peaks predict under a memory
    budget, else by halving; workers.bracket)."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(
        1024,
        ge=1,
        description="First length tried; a model cell with a memory budget starts from its "
        "predicted maximum instead (and brackets it).",
    )
    max: int = Field(1 << 24, ge=1, description="Never probe beyond this length.")
    granularity: int = Field(
        1024,
        ge=1,
        description="The search stops once the longest length that fit and the shortest that did "
        "not are at most this far apart.",
    )
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

    workload: Workload = Field(
        "attention",
        description="attention: time the kernel alone on random q, k, v; model: train a "
        "decoder (`model`, `training`) whose attention is the kernel.",
    )
    kernel: str = Field(description="A name from attention.KERNELS.")
    params: dict[str, Any] = Field(default_factory=dict, description="The kernel's parameters.")
    seq_len: int = Field(ge=1, description="Total tokens per sequence (across all ranks).")
    batch_size: int = Field(1, ge=1, description="Sequences per batch (global, across ranks).")
    num_heads: int = Field(8, ge=1, description="Query heads.")
    num_kv_heads: int | None = Field(
        None,
        ge=1,
        description="Key/value heads (grouped-query attention; 1: multi-query); must divide "
        "num_heads. None: num_heads. A model cell takes its model's num_kv_heads.",
    )
    head_dim: int = Field(64, ge=1, description="Channels per head.")
    dtype: Dtype = Field("float32", description="q, k, v and output precision.")
    causal: bool = Field(False, description="Mask future keys (autoregressive attention).")
    mode: Mode = Field("forward", description="forward: the forward pass; train: forward+backward.")
    world_size: int = Field(1, ge=1, le=4096, description="Ranks (one process, one GPU each).")
    parallel: Parallel = Field(
        "sequence",
        description="sequence: the ranks split each sequence (ring kernels); data: they split "
        "the batch. One rank has no parallel mode.",
    )
    device: Device = Field("auto", description="auto: CUDA where the rank has a GPU, else CPU.")
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="Hold each rank's peak to this (an emulated OOM above it)."
    )
    warmup: int = Field(2, ge=0, description="Untimed iterations before the timed ones.")
    iterations: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Timed iterations: an int runs exactly that many; auto (the default) "
        "repeats until the 95% confidence interval of the median (order statistics) is within "
        "+-3% of the median, with at least 6 and at most 200 iterations, or until time_cap_s "
        "(workers.noise). A model cell's timed steps follow the same rule. The count that ran "
        "is the length of each rank's times_s; every rank of a run runs the same count.",
    )
    time_cap_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="iterations auto only: stop repeating after this many seconds of timed "
        "iterations once 6 have run (None: 2 s). Refused beside an explicit iteration count.",
    )
    timeout_s: float = Field(600.0, gt=0, description="The whole run's wall-clock limit.")
    dist_timeout_s: float = Field(
        120.0, gt=0, description="torch.distributed init/collective timeout."
    )
    max_attempts: int = Field(1, ge=1, le=10, description="Tries before a failure is final.")
    placement: Placement = Field(
        "pack",
        description="pack: ranks on as few nodes as fit; spread: across nodes where possible; "
        "strict_spread: one node per rank.",
    )
    isolation: Isolation = Field(
        "gpu",
        description="gpu: the run holds its ranks' GPUs (CPUs on a CPU run) alone, beside "
        "other gangs on the same nodes; node: its scheduler runs nothing else while it runs "
        "(for timing-critical sweeps). Either way the run records the runs that shared its "
        "nodes (cotenants).",
    )
    fresh_processes: bool = Field(
        False, description="New rank processes for this run (no state from earlier runs)."
    )
    correctness_check: bool = Field(
        True,
        description="Check the kernel against its float64 reference before timing it (workers."
        "gate): every row at twice its structural period, sampled rows at seq_len. false: "
        "the run is not checked, and its outcome says so.",
    )
    profile: bool = Field(
        False,
        description="Save a torch.profiler Chrome trace of every iteration after the first "
        "(metered) one on every rank, the CPU meter being a profiler session itself (artifact "
        "trace-rank{r}.json; its times include the profiler's overhead); "
        "on CUDA also record the allocator's history for an OOM's memory snapshot.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**30 - 1,
        description="Seeds the inputs of every rank, and a layer kernel's weights (multihead).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="NCCL_* variables for the ranks.")
    search: SearchConfig | None = Field(
        None, description="Set from the sweep's `search` for kind max_seq_len."
    )
    model: ModelConfig | None = Field(None, description="workload model: the decoder trained.")
    training: TrainingConfig | None = Field(None, description="workload model: how it trains.")

    @model_validator(mode="before")
    @classmethod
    def _model_shape(cls, data: Any) -> Any:
        """A model cell's heads, head_dim, dtype, mode and causality follow from its model and
        precision: filled in when left out, refused below when they contradict."""
        if not isinstance(data, dict) or data.get("workload") != "model":
            return data
        model = data.get("model")
        if isinstance(model, dict):
            try:
                parsed = ModelConfig.model_validate(model)
            except ValueError:
                return data  # the field's own errors are reported
            data = {
                "num_heads": parsed.n_heads,
                "num_kv_heads": parsed.num_kv_heads,
                "head_dim": parsed.head_dim,
                **data,
            }
        training = data.get("training")
        if training is None:
            data = {**data, "training": {}}
            training = {}
        precision = training.get("precision", "fp32") if isinstance(training, dict) else None
        if isinstance(precision, str) and precision in PRECISION_DTYPES:  # else its own error
            data = {"dtype": PRECISION_DTYPES[precision], **data}
        return {"mode": "train", "causal": True, **data}

    @field_validator("iterations", mode="before")
    @classmethod
    def _iterations(cls, value: Any) -> Any:
        """One message for both forms (the union's own names each branch)."""
        ok_int = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if value != "auto" and not ok_int:
            raise ValueError(f"an iteration count >= 1 or 'auto', got {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _only_nccl(cls, value: dict[str, str]) -> dict[str, str]:
        """NCCL_* names that are valid environment variable names, values without NUL or line
        breaks: anything else makes Ray fail to start the ranks (the run then hangs until its
        timeout), so it is refused at submit, naming the key."""
        bad = sorted(k for k in value if not k.startswith("NCCL_"))
        if bad:
            raise ValueError(f"only NCCL_* variables pass through, got {', '.join(bad)}")
        if len(value) > MAX_ENV_VARS:
            raise ValueError(f"at most {MAX_ENV_VARS} variables, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_ENV_CHARS or len(text) > MAX_ENV_CHARS:
                raise ValueError(
                    f"{key[:40]}: names and values are at most {MAX_ENV_CHARS} characters "
                    f"(every run stores its own copy), got {max(len(key), len(text))}"
                )
            if not ENV_NAME.fullmatch(key):
                raise ValueError(
                    f"{key!r} is no environment variable name (upper-case letters, digits "
                    "and _, not starting with a digit)"
                )
            if any(c in text for c in ENV_VALUE_FORBIDDEN):
                raise ValueError(f"{key}: a value holds no NUL, CR or LF character")
        return value

    @field_validator("params")
    @classmethod
    def _params_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(value, default=str))
        if size > MAX_PARAMS_CHARS:
            raise ValueError(
                f"at most {MAX_PARAMS_CHARS} characters as JSON (every run stores its own "
                f"copy), got {size}"
            )
        return value

    @model_validator(mode="after")
    def _time_cap(self) -> RunConfig:
        if self.time_cap_s is not None and self.iterations != "auto":
            raise ParamError(
                "time_cap_s",
                f"bounds iterations: auto only; this cell runs exactly {self.iterations} "
                "iterations (leave time_cap_s out, or set iterations: auto)",
            )
        return self

    @model_validator(mode="after")
    def _workload(self) -> RunConfig:
        if self.workload == "attention":
            for name in ("model", "training"):
                if getattr(self, name) is not None:
                    raise ParamError(name, f"only a workload: model cell takes {name}")
            return self
        if self.model is None:
            raise ParamError(
                "model", "a workload: model cell needs a model (d_model, n_layers, ...)"
            )
        if self.training is None:
            raise ParamError("training", "a workload: model cell needs its training settings")
        model, training = self.model, self.training
        for name, want in (
            ("num_heads", model.n_heads),
            ("num_kv_heads", model.num_kv_heads),
            ("head_dim", model.head_dim),
            ("dtype", PRECISION_DTYPES[training.precision]),
            ("mode", "train"),
            ("causal", True),
        ):
            if getattr(self, name) != want:
                raise ParamError(
                    name,
                    f"a model cell's {name} is {want!r} (from its model and "
                    f"training.precision), not {getattr(self, name)!r}; leave it out",
                )
        spec = attention.KERNELS.get(self.kernel)
        if spec is not None and spec.input_layout != "bshd":
            raise ParamError(
                "kernel",
                f"{self.kernel} is a whole layer with its own projections; a model cell "
                "needs an attention kernel (dense, dilated, block_sparse, ring, ...)",
            )
        if training.optimizer == "adamw8bit":
            if self.device != "cuda":
                raise ParamError(
                    "training.optimizer",
                    "adamw8bit (bitsandbytes) runs on CUDA only; set "
                    f"device: cuda (this cell has device {self.device})",
                )
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ParamError(
                    "training.optimizer",
                    "adamw8bit needs bitsandbytes, which is not installed "
                    "(pip install 'ringlab[gpu]')",
                )
        return self

    @model_validator(mode="after")
    def _kernel_fits(self) -> RunConfig:
        if self.search is not None and self.params.get("document_lengths") is not None:
            raise ParamError(
                "params.document_lengths",
                "packed documents fix the sequence length, which a max_seq_len search varies; "
                "search without document_lengths",
            )

        if self.num_heads % self.kv_heads:
            raise ParamError(
                "num_kv_heads",
                f"{self.kv_heads} key/value heads must divide num_heads "
                f"({self.num_heads}): each kv head serves num_heads / num_kv_heads query heads",
            )
        if self.parallel == "data":
            if self.kernel in attention.KERNELS:
                attention.check_parallel(self.kernel, "data", self.world_size)
            if self.batch_size % self.world_size:
                raise ValueError(
                    f"parallel=data splits the batch: batch_size ({self.batch_size}) must be "
                    f"divisible by world_size ({self.world_size})"
                )
            shard_world = 1
        else:
            shard_world = self.world_size
        # A layer kernel's embed_dim / num_heads come from this cell's num_heads x head_dim;
        # params that contradict them are refused here (`params.embed_dim: ...`).
        params = attention.shape_params(
            self.kernel,
            self.params,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.kv_heads,
        )
        attention.validate(
            self.kernel,
            params,
            seq_len=self.seq_len,
            world_size=shard_world,
            num_heads=self.num_heads,
            causal=self.causal,
            num_kv_heads=self.kv_heads,
        )
        if self.device == "cuda":  # on auto the rank checks once its device resolved to CUDA
            attention.check_cuda_head_dim(
                self.kernel, getattr(torch, self.dtype), self.head_dim, params
            )
        return self

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when it is not set."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def local_batch(self) -> int:
        """Batch rows each rank holds."""
        return self.batch_size // self.world_size if self.parallel == "data" else self.batch_size

    @property
    def local_seq_len(self) -> int:
        """Tokens each rank holds."""
        return self.seq_len // self.world_size if self.parallel == "sequence" else self.seq_len
