"""The service's caps on a run (RunLimits: timeouts, warmup, batch size, iterations, the
elements of one attention call), each a check of the few fields it reads."""

from __future__ import annotations

from collections.abc import Callable

from service.core.config import RunLimits
from workers.config import RunConfig


def _over(field: str, value: float, cap: float, setting: str) -> tuple[str, str] | None:
    """(field, message) when value exceeds the cap named by RINGLAB_<setting>."""
    if value <= cap:
        return None
    return field, f"must be <= {_num(cap)} (RINGLAB_{setting}), got {_num(value)}"


def _num(value: float) -> str:
    """A cap or value as a message shows it: integers in full, other floats short."""
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    return f"{value:,g}"


Problems = list[tuple[tuple[str, ...], str]]


def _cap(field: str, cap: float, setting: str) -> Callable[[RunConfig], Problems]:
    """The check of one field against its cap (RINGLAB_<setting>)."""

    def check(config: RunConfig) -> Problems:
        over = _over(field, getattr(config, field), cap, setting)
        return [] if over is None else [(tuple(field.split(".")), over[1])]

    return check


def limit_checks(limits: RunLimits) -> list[Callable[[RunConfig], Problems]]:
    """The service's caps (RunLimits), each a check of the few fields it reads: a sweep's
    expansion remembers each one's answer per distinct value of those (service.spec_cells)."""

    def iterations(config: RunConfig) -> Problems:
        if config.iterations == "auto":
            return []
        return _cap("iterations", limits.iterations, "MAX_ITERATIONS")(config)

    def elements(config: RunConfig) -> Problems:
        longest = config.search.max if config.search is not None else config.seq_len
        total = longest * config.num_heads * config.head_dim
        if total <= limits.elements:
            return []
        what = "search.max" if config.search is not None else "seq_len"
        path = ("search", "max") if config.search is not None else ("seq_len",)
        return [
            (
                path,
                f"{what} x num_heads x head_dim = {total:,} must be <= {limits.elements:,} "
                "(RINGLAB_MAX_ELEMENTS)",
            )
        ]

    return [
        _cap("timeout_s", limits.timeout_s, "MAX_TIMEOUT_S"),
        _cap("dist_timeout_s", limits.timeout_s, "MAX_TIMEOUT_S"),
        _cap("warmup", limits.warmup, "MAX_WARMUP"),
        _cap("batch_size", limits.batch_size, "MAX_BATCH_SIZE"),
        iterations,
        elements,
    ]


def limit_problems(config: RunConfig, limits: RunLimits) -> Problems:
    """(path, message) for every field of `config` above the service's caps (RunLimits)."""
    return [problem for check in limit_checks(limits) for problem in check(config)]
