"""The one error type for a run's shape or a kernel's parameters: it names the field."""

from __future__ import annotations

import torch


class ParamError(ValueError):
    """A value of the run config refused at `path` (("params", "block_size"), ("seq_len",)),
    for `reason`. str() reads 'params.block_size: reason', the form users see; the service
    takes the path from the exception, not from the message."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path: tuple[str, ...] = tuple(path.split("."))
        self.reason = reason

    def __reduce__(self) -> tuple[type[ParamError], tuple[str, str]]:
        """Picklable (errors cross process boundaries: gloo ranks, Ray actors)."""
        return ParamError, (".".join(self.path), self.reason)


def is_allocation_failure(exc: BaseException) -> bool:
    """A CUDA OOM or a CPU allocation failure: the one rule for "this error is an oom" (the
    ring's abort flag and the worker's case status both read it)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and (
        "DefaultCPUAllocator: can't allocate memory" in str(exc) or "CUDA out of memory" in str(exc)
    )
