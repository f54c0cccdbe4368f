"""Document lengths: checked, sampled from a distribution, or read from a file.

Sampling is deterministic in its seed (Python's `random.Random`, the same on every platform):
lengths are drawn one by one, rounded to a multiple of `multiple_of` tokens (at least one such
unit), capped at `max_fraction` of the sequence, until they fill it; the last one is cut to
the tokens left, so they sum exactly to seq_len.
- uniform: lengths uniform on [1, 2 * mean - 1] (mean `mean`);
- lognormal: exp(N(mu, sigma^2)) with mu = ln(mean) - sigma^2 / 2 (mean `mean`; sigma 1 unless
  given), the long tail real corpora have.
The cap makes the realised mean lower than `mean` when it cuts often.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from attention.errors import ParamError

MAX_DOCUMENTS = 65_536
"""More documents than this in one sequence are refused (one check per document per step)."""

DISTRIBUTIONS = ("uniform", "lognormal")
SAMPLED_FIELDS = {"distribution", "mean", "max_fraction", "seed", "sigma", "multiple_of"}


def check_lengths(lengths: Any, path: str) -> tuple[int, ...]:
    """`lengths` as a tuple of positive ints, else ParamError at `path`."""
    if not isinstance(lengths, list | tuple) or not lengths:
        raise ParamError(path, f"expected a non-empty list, got {lengths!r}")
    if len(lengths) > MAX_DOCUMENTS:
        raise ParamError(path, f"at most {MAX_DOCUMENTS} documents, got {len(lengths)}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParamError(path, f"every length must be an integer >= 1, got {n!r}")
    return tuple(lengths)


def read_lengths_file(name: Any, path: str = "mask.lengths_file") -> tuple[int, ...]:
    """The lengths in file `name`: a JSON list of ints, or one int per line."""
    if not isinstance(name, str) or not name:
        raise ParamError(path, f"expected a file name, got {name!r}")
    try:
        text = Path(name).read_text()
    except OSError as exc:
        raise ParamError(path, f"cannot read {name!r}: {exc.strerror or exc}") from exc
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ParamError(path, f"{name!r} is not a JSON list: {exc.msg}") from exc
    else:
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    values.append(int(line))
                except ValueError as exc:
                    raise ParamError(
                        path, f"{name!r} line {number}: {line!r} is not an integer"
                    ) from exc
    return check_lengths(values, path)


def sample_lengths(spec: Any, seq_len: int, path: str = "mask.sampled") -> tuple[int, ...]:
    """Lengths drawn as `spec` says ({distribution, mean, max_fraction, seed, [sigma],
    [multiple_of]}), summing to seq_len, each <= max_fraction * seq_len."""
    dist, mean, cap, seed, sigma, unit = _sampled_fields(spec, seq_len, path)
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    total, out = seq_len // unit, []
    while total > 0:
        x = rng.uniform(1, 2 * mean - 1) if dist == "uniform" else rng.lognormvariate(mu, sigma)
        units = min(max(1, round(x / unit)), cap, total)
        out.append(units * unit)
        total -= units
    if len(out) > MAX_DOCUMENTS:
        raise ParamError(path, f"drew {len(out)} documents, more than {MAX_DOCUMENTS}")
    return tuple(out)


def _sampled_fields(spec: Any, seq_len: int, path: str) -> tuple[str, float, int, int, float, int]:
    """(distribution, mean, cap in units, seed, sigma, unit) of a `sampled` spec, checked."""
    if not isinstance(spec, dict):
        raise ParamError(path, f"expected a mapping, got {spec!r}")
    for key in spec:
        if key not in SAMPLED_FIELDS:
            raise ParamError(f"{path}.{key}", f"unknown field (known: {sorted(SAMPLED_FIELDS)})")
    dist = spec.get("distribution")
    if dist not in DISTRIBUTIONS:
        raise ParamError(f"{path}.distribution", f"must be one of {DISTRIBUTIONS}, got {dist!r}")
    mean = _number(spec, "mean", path, minimum=1)
    fraction = _number(spec, "max_fraction", path, minimum=0)
    if not 0 < fraction <= 1:
        raise ParamError(f"{path}.max_fraction", f"must be in (0, 1], got {fraction!r}")
    seed = spec.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ParamError(f"{path}.seed", f"expected an integer, got {seed!r}")
    if "sigma" in spec and dist != "lognormal":
        raise ParamError(f"{path}.sigma", "only the lognormal distribution takes sigma")
    sigma = _number(spec, "sigma", path, minimum=0) if "sigma" in spec else 1.0
    unit = spec.get("multiple_of", 1)
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1 or seq_len % unit:
        raise ParamError(
            f"{path}.multiple_of",
            f"must be an integer >= 1 dividing seq_len {seq_len}, got {unit!r}",
        )
    cap = math.floor(fraction * seq_len) // unit
    if cap < 1:
        raise ParamError(
            f"{path}.max_fraction",
            f"{fraction} of seq_len {seq_len} is shorter than one unit of {unit} tokens",
        )
    return dist, float(mean), cap, seed, float(sigma), unit


def _number(spec: dict[str, Any], key: str, path: str, minimum: float) -> float:
    """spec[key] as a number >= minimum, else ParamError."""
    value = spec.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < minimum
    ):
        raise ParamError(f"{path}.{key}", f"expected a number >= {minimum}, got {value!r}")
    return float(value)
