"""`ringlab kernels [NAME]`, read as printed against a live service: every kernel of
/api/v1/kernels with its params, their defaults and the masks it takes; one kernel by name; a
wrong name is one line with a did-you-mean."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _web_helpers import live_server, make_web_app
from typer.testing import CliRunner

import attention
from service.cli import app, console
from service.core.config import Settings

runner = CliRunner()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('kernels')) / 'ringlab.db'}"
    with live_server(make_web_app(Settings(database_url=url))) as base:
        yield base


@pytest.fixture(autouse=True)
def wide(served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLAB_URL", served)
    monkeypatch.delenv("RINGLAB_API_TOKEN", raising=False)
    monkeypatch.setattr(console.out, "width", 400)  # one printed line per line of text


def test_every_kernel_with_its_params_defaults_and_masks(served: str) -> None:
    result = runner.invoke(app, ["kernels"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    blocks = {b.split()[0]: b for b in result.stdout.strip().split("\n\n")}
    listed = httpx.get(f"{served}/api/v1/kernels").json()
    assert sorted(blocks) == [k["name"] for k in listed]
    for kernel in listed:
        block = blocks[kernel["name"]]
        if not kernel["available"]:
            assert "(unavailable)" in block and kernel["error"] in block
            continue
        for name, prop in kernel["params_schema"]["properties"].items():
            default = json.dumps(prop["default"]) if "default" in prop else "required"
            assert f"{name} = {default}" in block, (kernel["name"], name)
    assert (
        "  params: segment_lengths = [2048, 4096, 8192], dilation_rates = [1, 2, 4]"
        in (blocks["dilated"])
    )
    every = "full, causal, sliding_window, documents, prefix_lm"
    assert f"  masks: {every}\n" in blocks["dense"] and "balances" not in blocks["dense"]
    assert "  masks: full, causal\n" in blocks["dilated"]
    assert f"  masks: {every}\n  balances: none, head_tail, per_document, ptrr\n" in blocks["ring"]
    for kernel in listed:  # the lines say what the catalogue says, from the KernelSpecs
        if kernel["available"]:
            spec = attention.KERNELS[kernel["name"]]
            assert set(kernel["masks"]) == spec.masks and set(kernel["balances"]) == spec.balances
    assert blocks["ring"].startswith("ring  (sequence-parallel)\n")


def test_one_kernel_by_name_and_a_wrong_name() -> None:
    one = runner.invoke(app, ["kernels", "usp"], catch_exceptions=False)
    assert one.exit_code == 0, one.stderr
    assert one.stdout.splitlines()[0] == "usp  (sequence-parallel)"
    assert "  params: ulysses_degree = 2, layout = null, group = null" in one.stdout
    # one kernel: what its params mean, from its params class (allowed values, what null means)
    about = " ".join(one.stdout.split("about the params:", 1)[1].split())
    assert "ulysses_degree" in about and "layout" in about, one.stdout
    wrong = runner.invoke(app, ["kernels", "rng"], catch_exceptions=False)
    assert wrong.exit_code == 1
    assert wrong.stderr.strip() == "error: no kernel 'rng'; did you mean 'ring'?"
