"""The ring on sampled causal documents, timed: does each balance's measured compute follow its
kept pairs, and does a kept pair cost what it costs without documents?

`python -m bench.documents [--seq 16384] [--world 4] [--mean 2048] [--seeds 0] [--rounds 3]`
runs W gloo ranks (torch.multiprocessing, one thread each) that build `ring` with
attention.build for every configuration: causal documents (lognormal lengths of mean --mean,
each at most a quarter of the sequence and a multiple of 2 x W, as bench.balance samples them)
under each balance (none, head_tail, per_document, ptrr), and plain causal attention on the same
length (the ring's default zigzag layout). Each configuration first passes a correctness gate
at --gate-seq tokens (output and gradients against an fp64 dense reference from the explicit
mask). Then, for --rounds rounds, every configuration in turn runs --warmup untimed and
--iters timed forward+backward iterations with the step clock on (attention.ring.steps), so a
drifting machine falls on every configuration alike.

Per configuration it prints the medians and ranges (min-max) over the timed iterations of:
- the kept-pairs imbalance (max / mean over ranks of each rank's kept pairs, exact counts:
  layouts.rank_pairs on the module's own token order) and the measured compute imbalance of
  the same ranks, from the step clock's compute seconds (wall, perf_counter) and from the
  thread's CPU seconds over the same steps (time.thread_time);
- time per kept pair: the ranks' summed compute seconds (thread CPU time) over the mask's kept
  pairs x heads, and the iteration (the slowest rank's forward+backward) over the same pairs,
  each also as a ratio to plain causal, taken round by round (median of the rounds' ratios);
- the pairs the ring's plans compute over the kept pairs (1.0: a skipped pair is never
  computed) and the plans' block count (how finely the work is cut);
- the same blocks as bare fused calls (bare_seconds), per kept pair and as a ratio to plain
  causal: in the ranks, each rank its own blocks right after its ring iterations, all at
  once, so they share the cores as the ring's steps did; and alone, in the parent process
  with no rank running. Bare calls against causal's say what the op itself costs on the
  plan's tiles (small causal squares cost their whole square on CPU); the ring over its bare
  calls in the ranks, what the ring's per-block work adds; in the ranks against alone, what
  W ranks sharing fewer cores add (a preempted rank refills its caches).

The targets are judged on thread CPU time: with more ranks than cores a rank is preempted
inside its steps, and the wall clock charges that to whichever rank the scheduler picked, while
its CPU time counts only the work done; the wall figures are printed beside them.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attention
from attention import layouts
from attention.mask import parse
from attention.ring.dense import plan_for
from attention.ring.engine import (
    Block,
    cut_pieces,
    cut_plan,
    frozen,
    piece_size,
    tile_backward,
    tile_forward,
)
from attention.ring.steps import clock
from bench.balance import documents_mask, study_arguments

GATE_TOL = 1e-4
CAUSAL = "causal"
"""The configuration without documents (plain causal mask, the ring's default layout)."""


def configurations(seq: int, world: int, mean: int, seeds: list[int]) -> dict[str, dict]:
    """Name -> ring params (mask, balance) of every timed configuration, causal last."""
    out = {}
    for seed in seeds:
        mask = documents_mask(seq, world, mean, seed)
        for balance in layouts.BALANCES:
            out[f"seed {seed} {balance}"] = {"mask": mask, "balance": balance}
    out[CAUSAL] = {"mask": {"kind": "causal"}}
    return out


def token_order(module: torch.nn.Module, seq: int, world: int) -> torch.Tensor:
    """The global token at each position of the concatenated shards, as the module places them."""
    return torch.cat([module.local_positions(seq, r, world, causal=True) for r in range(world)])


def pairs_per_rank(params: dict, seq: int, world: int) -> list[int]:
    """Kept (query, key) pairs of each rank's queries (exact, one head)."""
    order = token_order(attention.build("ring", **params), seq, world)
    return layouts.rank_pairs(params["mask"], order, world).tolist()


def plan_figures(params: dict, seq: int, world: int) -> tuple[int, int]:
    """(pairs, blocks) of every rank's ring plan (one head): the pairs its blocks compute, to
    set beside the mask's kept pairs (equal: skipped pairs are never computed), and how many
    blocks they come in (before the engine cuts them into K/V pieces)."""
    module = attention.build("ring", **params)
    n = seq // world
    plans = [plan_for(module.params, "zigzag", True, r, world, n) for r in range(world)]
    blocks = [blk for plan in plans for step in plan for blk in step]
    return sum(blk.pairs() for blk in blocks), len(blocks)


def _bare_call(blk: Block, t: tuple[torch.Tensor, ...], backward: bool, scale: float) -> None:
    """One block's fused forward or backward as a bare primitive call on rows of `t`."""
    q, k, v, dout, out, lse = t
    rows, keys = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
    tile = (q[:, rows], k[:, keys], v[:, keys])
    if backward:
        saved = (dout[:, rows], *tile, out[:, rows], lse[:, :, rows])
        tile_backward(saved, blk, blk.keep(), scale)
    else:
        tile_forward(tile, blk, blk.keep(), scale)


def rank_blocks(
    params: dict, seq: int, world: int, heads: int, dim: int, rank: int
) -> tuple[list[Block], list[Block]]:
    """(forward, backward) blocks of `rank`'s ring plan, cut into K/V pieces and query chunks as
    the ring cuts them on CPU (engine.cut_plan; the backward's pieces are bounded in bytes)."""
    module = attention.build("ring", **params)
    n = seq // world
    fold = "balance" not in params  # plain causal zigzag folds its pieces (RingAttention)
    plan = frozen(plan_for(module.params, "zigzag", True, rank, world, n))
    cuts = []
    for row_bytes in (0, heads * dim * 4):  # forward, backward
        p = piece_size(n, torch.device("cpu"), row_bytes, parts=2 if fold else 1)
        pieces = cut_plan(plan, tuple(cut_pieces(n, p, fold)), p, n)
        cuts.append([blk for steps in pieces for blocks in steps for blk in blocks])
    return cuts[0], cuts[1]


def bare_seconds(
    params: dict, seq: int, world: int, heads: int, dim: int, ranks: Sequence[int]
) -> float:
    """Thread CPU seconds of the blocks of `ranks` (rank_blocks) run as bare primitive calls
    (forward and backward, all heads a call) one after another on this thread: what the fused
    op itself costs on the plan's tiles, without the ring's merges, transfers and
    accumulators. The plans are cut before the clock starts."""
    blocks = [rank_blocks(params, seq, world, heads, dim, r) for r in ranks]
    n = seq // world
    g = torch.Generator().manual_seed(1)
    tensors = (
        *(torch.randn(1, n, heads, dim, generator=g) for _ in range(5)),
        torch.zeros(1, heads, n),
    )
    t0 = time.thread_time()
    for forward, backward in blocks:
        for blk in forward:
            _bare_call(blk, tensors, False, dim**-0.5)
        for blk in backward:
            _bare_call(blk, tensors, True, dim**-0.5)
    return time.thread_time() - t0


# ---- one rank's work ---------------------------------------------------------------------------


def _inputs(seq: int, heads: int, dim: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, heads, dim, generator=g, dtype=dtype) for _ in range(4)]


def reference(q, k, v, dout, keep: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """fp64 dense attention under the explicit (S, S) mask `keep`: out, dq, dk, dv."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def gate(a: dict, name: str, rank: int, world: int) -> None:
    """Raise unless the ring's output and gradients at --gate-seq tokens (the configuration's
    mask sampled at that length) equal the fp64 reference's on this rank's tokens."""
    seq = a["gate_seq"]
    params = a["gate_configs"][name]
    module = attention.build("ring", **params)
    mine = token_order(module, seq, world).view(world, -1)[rank]
    tokens = torch.arange(seq)
    keep = parse(params["mask"], seq).keep(tokens[:, None], tokens[None, :])
    q, k, v, dout = _inputs(seq, a["heads"], a["dim"], 321, torch.float32)
    want = reference(q, k, v, dout, keep)
    ql, kl, vl = (t[:, mine].clone().requires_grad_() for t in (q, k, v))
    out = module(ql, kl, vl, causal=True)
    out.backward(dout[:, mine])
    got_all = (out, ql.grad, kl.grad, vl.grad)
    for what, got, ref in zip(("out", "dq", "dk", "dv"), got_all, want, strict=True):
        err = (got.double() - ref[:, mine]).abs().max().item()
        if err > GATE_TOL:
            raise AssertionError(f"gate {name}: rank {rank} {what} max error {err:.2e}")


def timed(a: dict, name: str, rank: int, world: int, round_: int) -> list[dict]:
    """--warmup untimed and --iters timed forward+backward iterations of one configuration;
    per timed iteration this rank's wall seconds and the step clock's sums."""
    module = attention.build("ring", **a["configs"][name])
    mine = token_order(module, a["seq"], world).view(world, -1)[rank]
    q, k, v, dout = (t[:, mine] for t in _inputs(a["seq"], a["heads"], a["dim"], 0, torch.float32))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rows = []
    for i in range(a["warmup"] + a["iters"]):
        dist.barrier()
        clock.start(torch.device("cpu"), thread_time=True)
        t0 = time.perf_counter()
        module(q, k, v, causal=True).backward(dout)
        wall = time.perf_counter() - t0
        steps = clock.collect()
        clock.stop()
        q.grad = k.grad = v.grad = None
        if i >= a["warmup"]:
            rows.append(
                {
                    "round": round_,
                    "iteration": i - a["warmup"],
                    "wall_s": wall,
                    "compute_s": sum(s["compute_s"] for s in steps),
                    "compute_thread_s": sum(s["compute_thread_s"] for s in steps),
                    "wait_s": sum(s["wait_s"] for s in steps),
                }
            )
    return rows


def _rank_main(rank: int, world: int, port: int, a: dict, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=900),
        )
        for name in a["configs"]:
            gate(a, name, rank, world)
        got: dict[str, list[dict]] = {name: [] for name in a["configs"]}
        bare: dict[str, list[float]] = {name: [] for name in a["configs"]}
        for r in range(a["rounds"]):
            for name, params in a["configs"].items():
                got[name] += timed(a, name, rank, world, r)
                dist.barrier()  # every rank's bare calls at once, as its ring steps ran
                args = (params, a["seq"], world, a["heads"], a["dim"], [rank])
                bare[name].append(bare_seconds(*args))
        out.put(("ok", rank, (got, bare)))
    except BaseException as exc:  # the parent prints it and stops
        out.put(("error", rank, f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RankResult = tuple[dict[str, list[dict]], dict[str, list[float]]]
"""A rank's timed rows by configuration, and its bare calls' thread CPU seconds by
configuration, one per round."""


def run_ranks(a: dict) -> list[RankResult]:
    """Every rank's results, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    world = a["world"]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, a, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, RankResult] = {}
    for _ in range(world):
        status, rank, value = out.get()
        if status == "error":
            for p in procs:
                p.kill()
            raise SystemExit(f"bench failed: {value}")
        results[rank] = value
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


# ---- report ------------------------------------------------------------------------------------


def alone_times(a: dict) -> dict[str, list[float]]:
    """Name -> bare_seconds of every rank's blocks in this process, no rank running, one per
    round, the configurations alternating, on one intra-op thread as each rank runs (thread
    CPU time counts the calling thread only): the op's cost of the tiles on an idle core."""
    out: dict[str, list[float]] = {name: [] for name in a["configs"]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(a["rounds"]):
            for name, params in a["configs"].items():
                args = (params, a["seq"], a["world"], a["heads"], a["dim"], range(a["world"]))
                out[name].append(bare_seconds(*args))
    finally:
        torch.set_num_threads(threads)
    return out


def summarize(
    ranks: list[RankResult],
    pairs: dict[str, list[int]],
    plans: dict[str, tuple[int, int]],
    heads: int,
    alone: dict[str, list[float]],
) -> dict:
    """Name -> the printed numbers (see the module docstring), from every rank's rows."""
    out: dict[str, dict] = {}
    for name, per_rank in pairs.items():
        rows = [r[0][name] for r in ranks]  # rows[rank][timed iteration], same order everywhere
        total = sum(per_rank) * heads
        its = list(zip(*rows, strict=True))
        wall = [max(x["wall_s"] for x in it) for it in its]
        thread = [sum(x["compute_thread_s"] for x in it) / total * 1e9 for it in its]
        rounds = [it[0]["round"] for it in its]
        in_ranks = [sum(r) / total * 1e9 for r in zip(*(r[1][name] for r in ranks), strict=True)]
        out[name] = {
            "pairs_per_rank": per_rank,
            "plan_over_kept": plans[name][0] / sum(per_rank),
            "blocks": plans[name][1],
            "pairs_imbalance": layouts.imbalance(torch.tensor(per_rank)),
            "compute_imbalance": [
                layouts.imbalance(torch.tensor([x["compute_s"] for x in it])) for it in its
            ],
            "thread_imbalance": [
                layouts.imbalance(torch.tensor([x["compute_thread_s"] for x in it])) for it in its
            ],
            "thread_ns_per_pair": thread,
            "wall_ns_per_pair": [w / total * 1e9 for w in wall],
            "iteration_s": wall,
            "rounds": rounds,
            "bare_ns_per_pair": in_ranks,
            "ring_over_bare": [
                statistics.median(x for x, rr in zip(thread, rounds, strict=True) if rr == r) / b
                for r, b in enumerate(in_ranks)
            ],
            "alone_ns_per_pair": [x / total * 1e9 for x in alone[name]],
        }
    return out


def round_ratios(num: dict, den: dict, key: str) -> list[float]:
    """Per round, the median of `key` of `num` over the median of `den`'s (same round)."""
    ratios = []
    for r in sorted(set(num["rounds"])):
        a = [x for x, rr in zip(num[key], num["rounds"], strict=True) if rr == r]
        b = [x for x, rr in zip(den[key], den["rounds"], strict=True) if rr == r]
        ratios.append(statistics.median(a) / statistics.median(b))
    return ratios


def _m(xs: list[float], fmt: str) -> str:
    """median (min-max)"""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def _per_round_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num / den (one value of each per round)."""
    return statistics.median(x / y for x, y in zip(num, den, strict=True))


def report(summary: dict, seeds: list[int]) -> list[str]:
    """The tables' lines: per configuration its pairs and measured imbalances, then its time
    per pair (the ring's, its blocks' as bare calls in the ranks and alone); per seed the
    verdicts on the best balance (the lowest pairs imbalance)."""
    base = summary[CAUSAL]
    lines = [
        f"{'configuration':>22}  {'pairs imb':>9}  {'measured imb: thread CPU':>24}  "
        f"{'wall':>19}  {'plan/kept':>9}  {'blocks':>6}"
    ]
    for name, s in summary.items():
        lines.append(
            f"{name:>22}  {s['pairs_imbalance']:9.4f}  {_m(s['thread_imbalance'], '.3f'):>24}  "
            f"{_m(s['compute_imbalance'], '.3f'):>19}  {s['plan_over_kept']:9.4f}  "
            f"{s['blocks']:6d}"
        )
    lines.append(
        f"{'ns per kept pair':>22}  {'ring: thread CPU':>24}  {'vs causal':>6}  "
        f"{'iteration (wall)':>24}  {'vs causal':>6}  {'bare calls in the ranks':>24}  "
        f"{'vs causal':>6}  {'ring/bare':>9}  {'bare calls alone':>24}  {'vs causal':>6}"
    )
    for name, s in summary.items():
        s["thread_ratio"] = statistics.median(round_ratios(s, base, "thread_ns_per_pair"))
        s["wall_ratio"] = statistics.median(round_ratios(s, base, "wall_ns_per_pair"))
        s["bare_ratio"] = _per_round_ratio(s["bare_ns_per_pair"], base["bare_ns_per_pair"])
        s["alone_ratio"] = _per_round_ratio(s["alone_ns_per_pair"], base["alone_ns_per_pair"])
        lines.append(
            f"{name:>22}  {_m(s['thread_ns_per_pair'], '.3f'):>24}  {s['thread_ratio']:6.3f}  "
            f"{_m(s['wall_ns_per_pair'], '.3f'):>24}  {s['wall_ratio']:6.3f}  "
            f"{_m(s['bare_ns_per_pair'], '.3f'):>24}  {s['bare_ratio']:6.3f}  "
            f"{statistics.median(s['ring_over_bare']):9.3f}  "
            f"{_m(s['alone_ns_per_pair'], '.3f'):>24}  {s['alone_ratio']:6.3f}"
        )
    for seed in seeds:
        names = [n for n in summary if n.startswith(f"seed {seed} ")]
        best = min(names, key=lambda n: summary[n]["pairs_imbalance"])
        s = summary[best]
        gap = statistics.median(s["thread_imbalance"]) / s["pairs_imbalance"] - 1
        gap_wall = statistics.median(s["compute_imbalance"]) / s["pairs_imbalance"] - 1
        lines.append(
            f"seed {seed}: best balance {best.split()[-1]} (pairs {s['pairs_imbalance']:.4f}): "
            f"measured thread-CPU imbalance {gap:+.1%} from pairs (target within 10%: "
            f"{'met' if abs(gap) <= 0.10 else 'NOT met'}; wall {gap_wall:+.1%}); time per kept "
            f"pair {s['thread_ratio']:.3f}x causal's (target <= 1.2: "
            f"{'met' if s['thread_ratio'] <= 1.2 else 'NOT met'}; iteration "
            f"{s['wall_ratio']:.3f}x); its blocks as bare fused calls {s['bare_ratio']:.3f}x "
            f"in the ranks, {s['alone_ratio']:.3f}x alone; the ring over its bare calls "
            f"{statistics.median(s['ring_over_bare']):.3f}x (causal "
            f"{statistics.median(base['ring_over_bare']):.3f}x)"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(ap)
    ap.add_argument("--seeds", default="0", help="comma list of the masks' sampling seeds")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="head_dim")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per round")
    ap.add_argument("--iters", type=int, default=2, help="timed iterations per round")
    ap.add_argument("--gate-seq", type=int, default=512, help="tokens of the correctness gate")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run, print the setup and the table; the raw rows by rank, the pairs per rank and the
    summary (for tests)."""
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    gate_mean = max(1, args.mean * args.gate_seq // args.seq)  # the same shape, shrunk
    a = {
        **vars(args),
        "configs": configurations(args.seq, args.world, args.mean, seeds),
        "gate_configs": configurations(args.gate_seq, args.world, gate_mean, seeds),
    }
    load = os.getloadavg()
    print(
        f"setup: ring, causal documents (lognormal, mean {args.mean:,} tokens, each at most "
        f"{args.seq // 4:,}, multiples of {2 * args.world}; mask seeds {seeds}) under each "
        f"balance, and plain causal (zigzag); seq {args.seq:,}, W={args.world} gloo ranks x 1 "
        f"thread, heads {args.heads}, head_dim {args.dim}, fp32 cpu, inputs seed 0; "
        f"forward+backward, {args.rounds} alternating rounds x ({args.warmup} warm-up + "
        f"{args.iters} timed); gate at {args.gate_seq} tokens vs fp64 (tol {GATE_TOL}); "
        f"os.cpu_count()={os.cpu_count()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    pairs = {n: pairs_per_rank(p, args.seq, args.world) for n, p in a["configs"].items()}
    plans = {n: plan_figures(p, args.seq, args.world) for n, p in a["configs"].items()}
    t0 = time.perf_counter()
    ranks = run_ranks(a)
    alone = alone_times(a)
    summary = summarize(ranks, pairs, plans, args.heads, alone)
    for line in report(summary, seeds):
        print(line)
    load = os.getloadavg()
    print(
        f"took {time.perf_counter() - t0:.0f} s; load average after {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}; medians over rounds x timed iterations, (min-max); imbalance: max / "
        f"mean over ranks; ns/pair: per kept (query, key) pair and head, the ranks' summed "
        f"compute (thread CPU) or the slowest rank's iteration (wall); plan/kept: the pairs the "
        f"ring's plan computes over the mask's kept pairs (1: none computed and discarded); "
        f"blocks: the plans' blocks over all ranks and steps (before K/V pieces); bare calls: "
        f"each rank's blocks, cut as the ring cuts them, as bare fused calls (thread CPU, each "
        f"of {args.rounds} alternating rounds; vs causal: median of the rounds' ratios), in the "
        f"ranks (all at once, right after their ring iterations, sharing the cores as they "
        f"did) and alone (one process, no rank running): the op's own cost of the tiles, "
        f"without the ring's merges, transfers and accumulators; ring/bare: the ring's thread "
        f"CPU over its bare calls in the ranks, round by round"
    )
    return {"ranks": ranks, "pairs": pairs, "summary": summary, "alone": alone}


if __name__ == "__main__":
    main()
