"""The stored results read back as the engine declared them (workers.results): a rank result,
a probe and a memory component from their rows, with what the service keeps beside them.

workers/results.py declares what a rank measures; service.db.models generates the tables
from it; these read the rows back into the same models (from_attributes), so the read model
(service.results.rows), the API and the pages name every measured field as the engine does.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_validator,
)

from workers import results


class StoredRank(results.RankResult):
    """What one rank measured (workers.results.RankResult) and the node it ran on."""

    model_config = ConfigDict(from_attributes=True)

    node: str | None = Field(
        None, description="The node the rank ran on (its Ray node's IP; None before 0016)."
    )

    @property
    def tflops_per_s(self) -> float | None:
        """What this rank computed per second at its median, in TFLOP/s (None without a time)."""
        return self.flops / self.median_s / 1e12 if self.median_s else None

    @property
    def peak_below_inputs(self) -> bool:
        """Whether the rank's peak is below the inputs it held while the peak was metered: the
        peak counts those inputs, so the meter missed memory (rows_build.peak_flags raises the
        flag)."""
        held = self.input_memory_bytes
        return held is not None and self.peak_memory_bytes < held

    @property
    def step_wait_share(self) -> float | None:
        """The share of this rank's ring-step time spent blocked on transfers (None without
        steps, or with none of their time)."""
        compute, wait = self.step_compute_s, self.step_wait_s
        if compute is None or wait is None or not compute + wait:
            return None
        return wait / (compute + wait)


class StoredStep(results.StepTime):
    """One ring step of one rank in one timed iteration (workers.results.StepTime), as stored
    (table ring_step), with its rank."""

    model_config = ConfigDict(from_attributes=True, extra="ignore")

    rank: int = Field(ge=0, description="The rank that ran the step.")


class StoredProbe(results.ProbeResult):
    """One tried length of a search (workers.results.ProbeResult), as stored."""

    model_config = ConfigDict(from_attributes=True)

    @field_validator("rank_peak_bytes", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        """Probes stored before 0002 hold no per-rank peaks: NULL reads as none."""
        return [] if value is None else value


class _OfRank(BaseModel):
    rank: int = Field(description="The rank it was measured on.")


class StoredComponent(results.MemoryComponent, _OfRank):
    """One memory component of a model run's rank (workers.results.MemoryComponent), its rank
    first; read back from its JSON (results.json), its ratio is computed again."""

    model_config = ConfigDict(from_attributes=True)

    @model_validator(mode="before")
    @classmethod
    def _without_ratio(cls, value: Any) -> Any:
        """Its JSON carries the computed ratio: not an input (it is computed again)."""
        if isinstance(value, dict) and "ratio" in value:
            return {k: v for k, v in value.items() if k != "ratio"}
        return value

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when either is missing or the prediction is 0)."""
        if self.measured_bytes is None or not self.predicted_bytes:
            return None
        return self.measured_bytes / self.predicted_bytes
