"""/api/v1/kernels: the kernel catalogue with each kernel's parameter JSON schema."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import TypeAdapter

import attention
from attention.layouts import BALANCES
from attention.mask import KINDS
from service.api.deps import require_read
from service.api.schemas import KernelOut

router = APIRouter(prefix="/kernels", tags=["kernels"], dependencies=[Depends(require_read)])


def catalogue() -> list[KernelOut]:
    """Every registered kernel with its params dataclass as JSON schema (a plugin's with its
    package and version), and every plugin that failed to load, with its error; by name."""
    found = [
        KernelOut(
            name=spec.name,
            description=spec.description,
            distributed=spec.distributed,
            params_schema=TypeAdapter(spec.params).json_schema(),
            package=spec.plugin.package if spec.plugin else None,
            version=spec.plugin.version if spec.plugin else None,
            masks=[k for k in KINDS if k in spec.masks],
            balances=[b for b in BALANCES if b in spec.balances],
        )
        for spec in attention.KERNELS.values()
    ]
    found += [
        KernelOut(
            name=bad.name,
            description=f"unavailable: plugin {bad.plugin.package} {bad.plugin.version}",
            distributed=False,
            params_schema=None,
            available=False,
            error=bad.error,
            package=bad.plugin.package,
            version=bad.plugin.version,
        )
        for bad in attention.UNAVAILABLE.values()
        if bad.name not in attention.KERNELS  # a kernel of that name exists: listed above
    ]
    return sorted(found, key=lambda k: k.name)


@router.get("")
def list_kernels() -> list[KernelOut]:
    """The kernels a run config may name, whether they shard the sequence, and their params."""
    return catalogue()
