"""The device check's budget, computed before a device is lent (`device_check.sh --plan`).

    bash scripts/device_check.sh --plan

For every step of the check it lists the cells the step runs, read from the step's own
definitions (never a copy of them): scripts/device_protocol.py's `cases`, the `CASES` of
tests/workers/test_cuda.py, the engine's example sweep expanded as the service expands it
(service.spec.expand), and bench.gpu's `check_list` and `timed_list`. Each cell's FLOPs come
from the kernel's own accounting (workers.kernels.flops, workers.training.model_flops), its
correctness gate's from workers.gate (the full check's length, the sampled check's rows); the
compilations it causes are counted per process as torch counts them: one forward graph per
distinct length, dtype, grad mode and mask of a torch.compile'd kernel (block_sparse's cuda
plan: FlexAttention), and one backward graph per forward graph that runs a backward. The
predicted time of a step is its start-up, plus FLOPs over the RATES below, plus its
compilations.

It prints one table per step and a total, and exits 1, naming why, when the total is over the
budget or a step's prediction is over its own timeout. The rates are H100 figures (the device
check runs on an H100 or an H200); each says where it comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workers import gate, kernels  # noqa: E402
from workers.config import RunConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Rate:
    """A figure the prediction uses, and where it comes from."""

    value: float
    source: str


RATES = {
    "bfloat16": Rate(400e12, "bf16 flash attention achieved on an H100 (issue 49's figure; "
                     "published: FlashAttention-2 330-370 and FlashAttention-3 600-650 TFLOP/s "
                     "forward at head_dim 128)"),
    "float16": Rate(400e12, "as bf16: the same flash kernels"),
    "float32": Rate(25e12, "fp32 attention (the efficient op, no tensor cores): about 40% of "
                    "the H100 SXM datasheet's 67 TFLOP/s fp32; an assumption, not measured"),
    "float64": Rate(15e12, "the float64 references of the correctness checks (masked matmuls "
                    "and softmax): about 20% of the datasheet's 67 TFLOP/s fp64 tensor "
                    "peak; an assumption, not measured"),
    "sparse": Rate(0.8, "dilated and block_sparse (and their ring twins) at 0.8x the rate of "
                   "their dtype on the FLOPs they compute: issue 49's target against SDPA "
                   "flash (published: FlexAttention at 85-90% of FlashAttention-2/3)"),
    "compile_graph": Rate(15.0, "one compiled graph of a kernel, its forward or its backward "
                          "(Triton kernels): half the middle of issue 49's 20-40 s for "
                          "forward plus backward"),
    "start": Rate(8.0, "a step's start-up: python, import torch, the CUDA context; assumed"),
    "engine_start": Rate(25.0, "the engine's start: db upgrade, serve and its local Ray "
                         "answering; assumed"),
    "rank_start": Rate(10.0, "one sweep's rank actor: a Ray worker process importing torch and "
                       "making its CUDA context; assumed"),
    "per_cell": Rate(1.0, "one engine cell's scheduling, database writes and result; assumed"),
    "install": Rate(20.0, "pip install of the wheelhouse (docs/device.md's expectation)"),
    "report": Rate(10.0, "ringlab results and report of each sweep (docs/device.md)"),
    "peak_over_floor": Rate(2.0, "a max_seq_len search's probe peak over the forward floor "
                            "(q, k, v, out and the lse): how far its doubling goes; assumed"),
    "narrow_probes": Rate(3.0, "probes a max_seq_len search makes after its first OOM, at the "
                          "bracket's top (workers.search narrows by measured peaks); assumed"),
}  # fmt: skip
"""Every figure of the prediction, with its source."""
SPARSE = ("dilated", "block_sparse", "ring_dilated", "ring_block_sparse")
CPU = torch.device("cpu")


@dataclasses.dataclass
class Cell:
    """What one cell costs: FLOPs by the rate they run at, and the compilations it causes."""

    label: str
    flops: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    compiles: int = 0

    def add(self, flops: float, dtype: str, kernel: str = "dense") -> None:
        """`flops` at `dtype`'s rate (a sparse kernel's at RATES["sparse"] of it)."""
        self.flops[dtype] = self.flops.get(dtype, 0.0) + flops
        rate = RATES[dtype].value * (RATES["sparse"].value if kernel in SPARSE else 1.0)
        self.seconds += flops / rate

    def compile(self, key: str, seen: set[str]) -> None:
        """One graph's compilation, if this process has not compiled `key` yet."""
        if key in seen:
            return
        seen.add(key)
        self.compiles += 1
        self.seconds += RATES["compile_graph"].value


@dataclasses.dataclass
class Step:
    """One step of the check: its cells, its fixed costs, its timeout (the check's cap)."""

    name: str
    cap_s: int
    fixed_s: float
    cells: list[Cell]
    entries: list[int] = dataclasses.field(default_factory=list)
    """Compiled entries (forward graphs: what the recompile limit counts) of each of the step's
    processes."""
    unpredicted: list[str] = dataclasses.field(default_factory=list)
    """What the step runs and the plan cannot predict (a problem: the check must not run it)."""

    @property
    def predicted_s(self) -> float:
        return self.fixed_s + sum(c.seconds for c in self.cells)


def entries_of(seen: set[str]) -> int:
    """A process's compiled entries: its forward graphs (a backward graph is no entry)."""
    return sum(not key.startswith("backward") for key in seen)


def compiled(kernel: str, params: dict[str, Any], device: torch.device) -> bool:
    """Whether the kernel runs torch.compile'd on `device`: block_sparse's cuda plan."""
    if kernel != "block_sparse":
        return False
    from attention.block_sparse import BlockSparseParams, resolve_plan

    return resolve_plan(BlockSparseParams(**params).plan, device) == "cuda"


def graph_keys(shape: object, seq: int, grad: bool, backward: bool) -> list[str]:
    """The graphs a compiled kernel's call at `seq` needs: its forward graph (keyed on the
    shape, dtype and mask in `shape`, the length and the grad mode) and, when it runs a
    backward, that graph's backward."""
    forward = json.dumps(["forward", shape, seq, grad], sort_keys=True, default=str)
    return [forward, "backward " + forward] if backward else [forward]


def _reference(cell: Cell, config: RunConfig, rows: int, seq: int) -> None:
    """A float64 reference over `rows` query rows and `seq` keys (every pair: masks come after
    the scores), forward and, in train mode, backward (3.5x)."""
    pairs = config.local_batch * config.num_heads * rows * seq
    cell.add(4.0 * pairs * config.head_dim * (3.5 if config.mode == "train" else 1.0), "float64")


def run_cell(
    config: RunConfig, kind: str, seen: set[str], label: str = "", oom: bool | None = None
) -> Cell:
    """One workers.protocol.run_case of `config` (`kind`: the sweep's): its gate (the full check
    at workers.gate.full_length, the sampled one at the run's length), its prime at the run's
    length, its warm-up and timed iterations; an input over the memory budget is an OOM after
    the gate, before any iteration (`oom`: whether the run runs out of memory; None: whether
    its inputs exceed its budget)."""
    cell = Cell(label or f"{config.kernel} {config.mode} {config.seq_len} {config.dtype}")
    if config.workload == "model":
        from workers.training import model_flops

        cell.add(model_flops(config) * (1 + config.warmup + config.iterations), config.dtype)
        return cell
    module = kernels.build(config, CPU)
    train = config.mode == "train"
    on_gpu = compiled(config.kernel, kernels.kernel_params(config), torch.device("cuda"))

    shape = config.model_dump(
        include={"kernel", "params", "dtype", "causal", "num_heads", "head_dim", "batch_size"}
    )

    def kernel_at(seq: int, times: int, grad: bool) -> None:
        flops = kernels.flops(module, config, config.local_batch, seq, train)
        cell.add(flops * times, config.dtype, config.kernel)
        for key in graph_keys(shape, seq, grad, train) if on_gpu else []:
            cell.compile(key, seen)

    seq = config.seq_len
    if kernels.gated(config, kind):  # the gate's kernel runs in the run's grad mode
        full = gate.full_length(config)
        kernel_at(full, 1, grad=train)
        _reference(cell, config, full, full)
        if full < seq:
            kernel_at(seq, 1, grad=train)
            _reference(cell, config, len(gate.sample_rows(config, seq)), seq)
    if not (over_budget(config) if oom is None else oom):
        kernel_at(seq, 1 + config.warmup + config.iterations, grad=train)
    return cell


def over_budget(config: RunConfig) -> bool:
    """Whether q, k and v alone exceed the run's memory budget (a deliberate OOM)."""
    if config.memory_budget_bytes is None:
        return False
    itemsize = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    tokens = config.local_batch * config.local_seq_len
    return 3 * tokens * config.num_heads * config.head_dim * itemsize > config.memory_budget_bytes


def _load(path: Path) -> ModuleType:
    """A script or test module of the repository, by its path (neither is a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def protocol_step(cap: int, proto_args: str) -> Step:
    """scripts/device_protocol.py's cases, in one process."""
    proto = _load(ROOT / "scripts" / "device_protocol.py")
    args = proto.parse(["--device", "cuda", *proto_args.split()])
    seen: set[str] = set()
    cells = [run_cell(config, "benchmark", seen, name) for name, config in proto.cases(args)]
    return Step("protocol", cap, RATES["start"].value, cells, [entries_of(seen)])


def cuda_tests_step(cap: int) -> Step:
    """tests/workers/test_cuda.py's run_case calls, each of its CASES as often as the file names
    it, in one pytest process; the primitive's CUDA tests (four calls of 1,000 x 1,500 tokens)
    are inside the start-up."""
    path = ROOT / "tests" / "workers" / "test_cuda.py"
    module, source = _load(path), path.read_text()
    seen: set[str] = set()
    cells = []
    for name, config in module.CASES.items():
        for _ in range(source.count(f'CASES["{name}"]')):
            cells.append(run_cell(config, "benchmark", seen, f"test_cuda {name}"))
    return Step("cuda-tests", cap, RATES["start"].value, cells, [entries_of(seen)])


def engine_step(cap: int, example: str) -> Step:
    """Every cell of the example's sweeps (service.spec.expand), each sweep in one rank process;
    a max_seq_len sweep's probes (`search_cells`)."""
    import yaml

    from service.spec import SweepSpec, expand

    cells, fixed, entries = [], RATES["engine_start"].value, []
    for doc in yaml.safe_load_all((ROOT / example).read_text()):
        spec = SweepSpec.model_validate(doc)
        seen: set[str] = set()
        fixed += RATES["rank_start"].value
        for c in expand(spec):
            found = (
                search_cells(c.config, spec.search, seen)
                if spec.kind == "max_seq_len"
                else [run_cell(c.config, spec.kind, seen)]
            )
            for cell in found:
                cell.seconds += RATES["per_cell"].value
            cells += found
        entries.append(entries_of(seen))
    return Step("engine", cap, fixed, cells, entries)


def search_cells(config: RunConfig, search: Any, seen: set[str]) -> list[Cell]:
    """A max_seq_len search's probes: doubling from search.start while the probe's peak
    (RATES["peak_over_floor"] x the forward floor) fits the budget (80 GB without one), the
    first that does not (an OOM after its gate), then RATES["narrow_probes"] probes at the
    bracket's middle."""
    itemsize = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    floor = config.local_batch * config.num_heads * (4 * config.head_dim * itemsize + 4)
    budget = config.memory_budget_bytes or 80e9
    fits = lambda n: n * floor * RATES["peak_over_floor"].value <= budget  # noqa: E731
    cells, length = [], search.start
    while length <= search.max:
        probe = config.model_copy(update={"seq_len": length})
        ok = fits(length)
        cells.append(run_cell(probe, "max_seq_len", seen, f"probe {length}", oom=not ok))
        if not ok:
            break
        length *= 2
    middle = max(search.start, length * 3 // 4 // search.granularity * search.granularity)
    for _ in range(int(RATES["narrow_probes"].value)):
        probe = config.model_copy(update={"seq_len": middle})
        cells.append(run_cell(probe, "max_seq_len", seen, f"probe {middle} (narrowing)"))
    return cells


def bench_step(cap: int, bench_args: str) -> Step:
    """bench.gpu's checks (`check_list`, each against its chunked float64 reference: forward
    twice under checkpoint and backward, 4.5x a forward) and timed rows (`timed_list`), in one
    process; the primitive's checks are inside the start-up. Its max-length searches are not
    predicted (a problem when the step runs them)."""
    from bench import gpu

    args = gpu.parse([*bench_args.split(), "--device", "cuda"])
    seen: set[str] = set()
    cells = [_bench_check(gpu, *c, seen) for c in gpu.check_list(args)]
    for dtype in args.dtypes:
        cells += [_bench_timed(gpu, args, dtype, *c, seen) for c in gpu.timed_list(args)]
    step = Step("bench", cap, RATES["start"].value, cells, [entries_of(seen)])
    if not args.no_search:  # each probe's length follows the peaks measured before it
        step.unpredicted.append("bench.gpu's max-length searches (--no-search skips them)")
    return step


def _bench_check(gpu: ModuleType, kernel: str, seq: int, dtype: str, causal: bool,
                 seen: set[str]) -> Cell:  # fmt: skip
    """One bench.gpu.check: the kernel forward+backward at one head, and its reference."""
    import attention

    params = gpu.scaled(kernel, seq)
    module = attention.build(kernel, **params)
    dim = gpu.CHECK_DIM["cuda"]
    cell = Cell(f"check {kernel}{' causal' if causal else ''} {seq} {dtype}")
    cell.add(module.flops(1, seq, 1, dim, causal=causal, backward=True), dtype, kernel)
    cell.add(4.0 * seq * seq * dim * 4.5, "float64")
    if compiled(kernel, params, torch.device("cuda")):
        for key in graph_keys([kernel, params, dtype, causal, 1, dim], seq, True, True):
            cell.compile(key, seen)
    return cell


def _bench_timed(gpu: ModuleType, args: argparse.Namespace, dtype: str, seq: int, kernel: str,
                 params: dict[str, Any], seen: set[str]) -> Cell:  # fmt: skip
    """One timed row (bench.kernels): measure_case runs the forward and forward+backward twice,
    time_case a warm-up and --repeats of each, the forwards paired with SDPA's (one warm-up
    and --repeats of SDPA's forward more, except for SDPA itself)."""
    import attention

    module = attention.build(kernel, **params)
    shape = (1, seq, args.heads, args.dim)
    calls = 3 + args.repeats
    cell = Cell(f"timed {kernel} {seq} {dtype}")
    cell.add(module.flops(*shape) * calls, dtype, kernel)
    cell.add(module.flops(*shape, backward=True) * calls, dtype, kernel)
    if kernel != "sdpa":
        cell.add(4.0 * seq * seq * args.heads * args.dim * (1 + args.repeats), dtype)
    if compiled(kernel, params, torch.device("cuda")):  # forward without grad, then with
        shape = [kernel, params, dtype, False, args.heads, args.dim]
        for key in graph_keys(shape, seq, False, False) + graph_keys(shape, seq, True, True):
            cell.compile(key, seen)
    return cell


def fixed_step(name: str, cap: int, rate: str) -> Step:
    """A step with no cells: its fixed cost."""
    return Step(name, cap, RATES[rate].value, [])


def plan(caps: dict[str, int], env: dict[str, str]) -> list[Step]:
    """Every step of the GPU check, in its order, with the check's own caps."""
    return [
        fixed_step("facts", caps["facts"], "start"),
        fixed_step("install", caps["install"], "install"),
        cuda_tests_step(caps["cuda-tests"]),
        protocol_step(caps["protocol"], env["PROTO_ARGS"]),
        engine_step(caps["engine"], env["EXAMPLE"]),
        fixed_step("report", caps["report"], "report"),
        bench_step(caps["bench"], env["BENCH_ARGS"]),
    ]


def recompile_limit() -> int:
    """The graphs one compiled kernel may hold in a process (attention.compiled: past it the
    call fails naming the kernel, never falling back unfused)."""
    from attention.compiled import RECOMPILE_LIMIT

    return RECOMPILE_LIMIT


def render(steps: list[Step], budget: int) -> tuple[str, list[str]]:
    """The printed plan, and what is wrong with it (a step over its cap, the total over the
    budget)."""
    lines = ["# The device check's plan (H100 rates; see the sources below)", ""]
    problems = []
    for step in steps:
        lines += [f"## {step.name}: predicted {step.predicted_s:.0f} s (timeout {step.cap_s} s; "
                  f"start-up and fixed costs {step.fixed_s:.0f} s; compiled entries per "
                  f"process {step.entries or '-'})"]  # fmt: skip
        if step.cells:
            lines += ["| cell | TFLOP | compilations | s |", "|---|---|---|---|"]
        for c in step.cells:
            tflop = sum(c.flops.values()) / 1e12
            lines.append(f"| {c.label} | {tflop:.3g} | {c.compiles} | {c.seconds:.1f} |")
        lines.append("")
        if step.predicted_s > step.cap_s:
            problems.append(f"step {step.name}: predicted {step.predicted_s:.0f} s is over its "
                            f"timeout of {step.cap_s} s")  # fmt: skip
    limit = recompile_limit()
    for step in steps:
        problems += [f"step {step.name}: not predicted: {u}" for u in step.unpredicted]
        if max(step.entries, default=0) > limit:
            problems.append(f"step {step.name}: a process compiles {max(step.entries)} entries, "
                            f"over the compiled kernels' recompile limit of {limit}")  # fmt: skip
    total = sum(s.predicted_s for s in steps)
    lines += ["## sources"] + [f"- {k} = {r.value:g}: {r.source}" for k, r in RATES.items()]
    compiles = sum(c.compiles for s in steps for c in s.cells)
    lines += ["", f"total predicted {total:.0f} s of the {budget} s budget "
              f"({compiles} compilations)"]  # fmt: skip
    if total > budget:
        problems.append(f"predicted {total:.0f} s is over the {budget} s budget")
    return "\n".join(lines), problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, required=True, help="seconds (DEVICE_CHECK_BUDGET_S)")
    ap.add_argument("--caps", required=True, help="'STEP=SECONDS ...': the check's timeouts")
    ap.add_argument("--proto-args", required=True)
    ap.add_argument("--bench-args", required=True)
    ap.add_argument("--example", required=True)
    args = ap.parse_args(argv)
    caps = {k: int(v) for k, v in (item.split("=") for item in args.caps.split())}
    env = {"PROTO_ARGS": args.proto_args, "BENCH_ARGS": args.bench_args, "EXAMPLE": args.example}
    text, problems = render(plan(caps, env), args.budget)
    print(text)
    for p in problems:
        print(f"device plan failed: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
