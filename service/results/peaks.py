"""Dense peak FLOP/s of known devices, from the vendors' datasheets (no sparsity).

Only devices listed here get a fraction of peak; for any other device (CPUs included) the
dashboard says it does not know the peak rather than inventing one. float32 peaks are the
CUDA-core rate: with TF32 matmuls enabled a float32 run can exceed 1.0 of it.
"""

from __future__ import annotations

# (substrings that must all appear in the device name, lower case) -> dtype -> FLOP/s.
# Order matters: the first match wins, so the more specific names come first.
KNOWN_PEAKS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    # H100 PCIe: 756 TFLOP/s bf16/fp16 tensor dense, 51 TFLOP/s fp32.
    (("h100", "pcie"), {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12}),
    # H100 SXM (and H100 80GB HBM3): 989 TFLOP/s bf16/fp16 dense, 67 TFLOP/s fp32.
    (("h100",), {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    # H200 SXM: the H100 SXM compute die.
    (("h200",), {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    # A100 (SXM and PCIe): 312 TFLOP/s bf16/fp16 dense, 19.5 TFLOP/s fp32.
    (("a100",), {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
    # L40S: 362 TFLOP/s bf16/fp16 tensor dense, 91.6 TFLOP/s fp32.
    (("l40s",), {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12}),
    # V100 SXM2: 125 TFLOP/s fp16 tensor, 15.7 TFLOP/s fp32 (no bf16).
    (("v100",), {"float16": 125e12, "float32": 15.7e12}),
    # GTX 1080: 8.9 TFLOP/s fp32 (Pascal GP104; fp16 runs at 1/64 rate).
    (("gtx 1080",), {"float32": 8.9e12, "float16": 0.139e12}),
)


def dense_peak_flops(device: str | None, dtype: str) -> float | None:
    """The device's dense peak for dtype in FLOP/s, or None when we do not know it."""
    if not device:
        return None
    name = device.lower()
    for needles, peaks in KNOWN_PEAKS:
        if all(n in name for n in needles):
            return peaks.get(dtype)
    return None
