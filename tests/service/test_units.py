"""service.units, the one formatter of bytes, times, rates and empties: each place that had its
own formatter reads the same text through it as before (report.md, the pages, the sequence-
parallel table, the terminal table, the regression gate, the charts' axes)."""

from __future__ import annotations

import pytest

from service import units
from service.units import DASH, EMPTY, GIB, KIB, MIB, nbytes


def test_bytes_as_report_md_and_the_pages_write_them() -> None:
    assert [nbytes(n) for n in (100, 1536, 6 * MIB.size, 3 * GIB.size, 1000 * MIB.size)] == [
        "100 B", "1.50 KiB", "6.00 MiB", "3.00 GiB", "1000.00 MiB",
    ]  # fmt: skip
    assert nbytes(2**41) == "2.00 TiB"
    assert (nbytes(None), nbytes(None, empty=DASH)) == ("-", "—")
    assert nbytes(512.7) == "513 B"  # whole bytes, rounded


def test_bytes_in_fixed_units_as_the_tables_and_the_gate_write_them() -> None:
    schemes = {"units": (MIB, KIB), "digits": 1, "grouped": True}
    assert nbytes(3 * GIB.size, **schemes) == "3,072.0 MiB"
    assert nbytes(512, **schemes) == "0.5 KiB"  # a tiny run's bytes, not 0.0 MiB
    big = 1234.5 * MIB.size
    assert nbytes(big, units=(MIB,), digits=1, grouped=True) == "1,234.5 MiB"  # the terminal
    assert nbytes(big, units=(MIB,), digits=1) == "1234.5 MiB"  # the regression gate
    assert nbytes(None, units=(MIB,), digits=1) == EMPTY


def test_the_unit_of_a_memory_axis() -> None:
    assert units.byte_unit([3, GIB.size]) is GIB
    assert units.byte_unit([5 * MIB.size]) is MIB
    assert units.byte_unit([100]) is units.byte_unit([]) is KIB
    assert GIB.of(3 * GIB.size) == 3.0


@pytest.mark.parametrize("digits", [0, 1])
def test_a_percentage_reads_as_the_templates_once_computed_it(digits: int) -> None:
    for i in range(2001):
        x = i / 1999
        assert units.percent(x, digits) == f"%.{digits}f%%" % (100 * x), x
    assert units.percent(None) == DASH


def test_rates_times_and_the_rest_of_a_page() -> None:
    assert units.rate(2048.0, "link_probe_bytes_per_s") == "2.00 KiB/s"
    assert units.rate(1.5, "tflops_per_s") == "1.5 TFLOP/s"
    assert units.rate(1.23e6, "tokens_per_s") == "1.23 Mtok/s"
    assert units.rate(5e9, "flops_per_s") == "5 GFLOP/s"
    assert (units.secs(0.0123), units.secs(4.2), units.secs(None)) == ("12.3 ms", "4.2 s", DASH)
    assert units.si(1234567, "B") == "1.23 MB" and units.si(12.0) == "12"
    assert units.micros(4.2e-5) == "42 µs" and units.micros(4.2e-5, "us", EMPTY) == "42 us"
    assert units.kilo(8224) == "8.2" and units.kilo(None) == DASH
    assert units.figure(3 * MIB.size, "peak_memory_bytes") == "3.00 MiB"
    assert units.figure(0.25, "median_s") == "250 ms"
    assert units.figure(12345, "max_seq_len") == "12,345"
    assert units.figure(0.123456, "efficiency") == "0.1235"
    assert units.figure(True, "searched") == "True"


def test_an_interval_bound_that_is_not_1_never_reads_1() -> None:
    """0.76-0.99957 does not hold 1.0 (not within noise): written at two decimals it read
    '0.76-1.00', which a reader takes for an interval reaching 1."""
    assert units.bound(0.99957) == "0.9996" and units.bound(1.0004) == "1.0004"
    assert units.bound(1.0) == "1.00" and units.bound(0.7612) == "0.76"
    assert units.bound(0.99957, 0, as_percent=True) == "99.96%"
    assert units.bound(0.5, 0, as_percent=True) == "50%"
