"""Benchmark: the training mask at the recipe's size, full attention beside a sliding window.

At 512 anchors x block 16 over 4096 tokens a dense mask is Q x KV = 8192 x 12288 entries per sequence
(what SDPA needs, rebuilt every step); the CUDA path builds FlexAttention's tile metadata instead
(masks.py). This measures, for full attention and for a sliding-window layer (window 2048, the
reference's Qwen3.6 drafters): the build time of the BlockMask (median of `--rounds`), its largest
intermediate tensor and the memory of what it keeps, the tiles the kernel visits out of all tiles,
and the dense mask's size for comparison. Torch runs one intra-op thread (set here), as a trainer
worker does with threads_per_worker 1; `--device cuda` builds on the GPU (times synchronised).

    python scripts/bench_masks.py [--json] [--quick] [--rounds 20] [--window 2048] [--device cpu]
"""

from __future__ import annotations

import statistics
import time

from _bench import ForeignLoad, bench_parser, print_report

ANCHORS, BLOCK, TOKENS, BATCH = 512, 16, 4096, 2


def captured_tensors(fn) -> list:
    """The tensors a mask_mod keeps alive: those in its closure, and in the closures of functions there."""
    import torch

    found = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif callable(value) and hasattr(value, "__closure__"):
            found += captured_tensors(value)
    return found


def measure(window: int | None, rounds: int, device: str) -> dict:
    """One kind of layer: build time, largest intermediate, kept bytes, visited tiles."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dflash.model.masks import flex_block_mask

    class Largest(TorchDispatchMode):
        """The largest tensor any aten op produced inside the block (elements and bytes)."""

        numel = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.numel() > self.numel:
                    self.numel, self.nbytes = o.numel(), o.numel() * o.element_size()
            return out

    g = torch.Generator().manual_seed(0)
    anchors = torch.randperm(TOKENS - BLOCK, generator=g)[:ANCHORS].sort().values.expand(BATCH, -1).to(device)
    valid = torch.ones(BATCH, TOKENS, dtype=torch.long, device=device)
    valid[1, 3000:] = 0  # one sequence right-padded

    def build():
        return flex_block_mask(anchors, BLOCK, TOKENS, valid, window=window)

    build()  # warm-up: lazy imports, first kernels
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        bm = build()
        sync()
        times.append(time.perf_counter() - t0)
    with Largest() as largest:
        build()
    kept = {id(t): t for t in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                               *captured_tensors(bm.mask_mod))}.values()
    partial, full = int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum())
    rows, cols = bm.kv_indices.shape[-2:]
    return {"build_ms": round(statistics.median(times) * 1e3, 2),
            "largest_intermediate_elements": largest.numel,
            "largest_intermediate_bytes": largest.nbytes,
            "kept_bytes": sum(t.numel() * t.element_size() for t in kept),  # metadata + lookup tables
            "tiles_visited": partial + full, "tiles_full": full, "tiles_total": BATCH * rows * cols}


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="two rounds (a smoke run; the figures mean little)")
    p.add_argument("--rounds", type=int, default=20, help="builds timed per kind (default 20; the median counts)")
    p.add_argument("--window", type=int, default=2048, help="the sliding window (default 2048)")
    p.add_argument("--device", default="cpu", help="where the mask is built: cpu or cuda (default cpu)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    q, kv = ANCHORS * BLOCK, TOKENS + ANCHORS * BLOCK
    report: dict = {"anchors": ANCHORS, "block": BLOCK, "tokens": TOKENS, "batch": BATCH, "window": args.window,
                    "device": args.device, "rounds": rounds, "dense_mask_bytes": BATCH * q * kv}
    with ForeignLoad() as load:
        for name, window in (("full", None), ("sliding", args.window)):
            report.update({f"{name}_{k}": v for k, v in measure(window, rounds, args.device).items()})
    report.update({"foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2})
    print_report(report, args.json)


if __name__ == "__main__":
    main()
