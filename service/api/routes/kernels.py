"""/api/v1/kernels: the kernel catalogue with each kernel's parameter JSON schema."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import TypeAdapter

from service.api.deps import require_read
from service.api.schemas import KernelOut

router = APIRouter(prefix="/kernels", tags=["kernels"], dependencies=[Depends(require_read)])


def catalogue() -> list[KernelOut]:
    """Every registered kernel, sorted by name, with its params dataclass as JSON schema."""
    import attention

    return [
        KernelOut(
            name=spec.name,
            description=spec.description,
            distributed=spec.distributed,
            params_schema=TypeAdapter(spec.params).json_schema(),
        )
        for spec in sorted(attention.KERNELS.values(), key=lambda s: s.name)
    ]


@router.get("")
def list_kernels() -> list[KernelOut]:
    """The kernels a run config may name, whether they shard the sequence, and their params."""
    return catalogue()
