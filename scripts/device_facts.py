"""The device check's facts step (scripts/device_check.sh): what the machine is, before anything.

torch, CUDA, cuDNN and NCCL versions, the GPU, and which SDPA backend torch picks for a bf16
call at the check's shape (read off the profiler's aten op: flash, efficient, cudnn or math);
on CPU the same in fp32. nvidia-smi, MemTotal and /dev/shm are the shell's (device_check.sh).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.profiler import profile


def sdpa_backend(device: str, dtype: torch.dtype) -> list[str]:
    """The aten SDPA ops one F.scaled_dot_product_attention call ran (b=1, h=16, 4K, d=128)."""
    q, k, v = (torch.randn(1, 16, 4096, 128, device=device, dtype=dtype) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v)  # warm: the first call may pick differently
    with profile() as prof:
        F.scaled_dot_product_attention(q, k, v)
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot")})


def main() -> int:
    device = "cuda" if "--cpu" not in sys.argv and torch.cuda.is_available() else "cpu"
    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gib = props.total_memory / 2**30
        print(f"gpu {props.name}  {gib:.1f} GiB  {props.multi_processor_count} SMs  "
              f"capability {props.major}.{props.minor}")  # fmt: skip
        print(f"cudnn {torch.backends.cudnn.version()}  nccl {torch.cuda.nccl.version()}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"sdpa backend for a {dtype} call on {device}: {', '.join(sdpa_backend(device, dtype))}")
    if "--cpu" not in sys.argv and device != "cuda":
        print("no CUDA device visible to torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
