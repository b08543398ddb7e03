"""Benchmark: a DFlash2 training step beside a DFlash one at the same shapes, on the CPU.

Both drafters have the same backbone (``--layers`` Qwen3-style layers of ``--hidden``, a target head of
``--vocab`` rows); DFlash2 adds the convolutions around every sublayer and the candidate selector
(rank ``--rank``, top ``--top-k``) with its loss term. One step is the objective's forward, backward
and the AdamW step, on ``--batch`` sequences of ``--tokens`` with ``--anchors`` blocks each. Reported:
the median step time of each, DFlash2's over DFlash's, each one's peak resident memory (each drafter
measured in its own process, so one's peak cannot hide the other's), the selector's share of
DFlash2's step (its ``selector`` span: the candidates' unary logits from their K columns of the head,
the re-ranking, its cross-entropy; its backward is inside the step's backward, not in the share),
and the codebooks' size with their AdamW state. Torch runs one intra-op thread (set here), as a trainer worker with
threads_per_worker 1.

    python scripts/bench_dflash2.py [--json] [--quick] [--steps 6] [--hidden 1024] [--vocab 32000] ...
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from _bench import ForeignLoad, bench_args, print_report

#: the command line: name -> (default, help)
OPTIONS = {"steps": (6, "measured steps per drafter (after one warm-up step)"),
           "hidden": (1024, "hidden size of the target and drafter"), "vocab": (32000, "the target head's rows"),
           "layers": (1, "drafter layers"), "block": (16, "block size"), "anchors": (64, "blocks per sequence"),
           "tokens": (1024, "tokens per sequence"), "batch": (1, "sequences per step"),
           "rank": (256, "DFlash2 selector rank"), "top_k": (16, "DFlash2 selector candidates")}
QUICK = ("tiny shapes and two steps: proves the script runs",
         dict(steps=2, hidden=128, vocab=2000, anchors=8, tokens=128, rank=32, top_k=8))


def one(kind: str, a: dict) -> dict:
    """Time ``a["steps"]`` training steps of one drafter kind in this process; its peak RSS."""
    import torch

    from dflash.model.blocks import plan_blocks
    from dflash.model.dflash2 import DFlash2Config, build_drafter
    from dflash.model.drafter import DrafterConfig
    from dflash.objectives import for_drafter
    from dflash.train.config import ObjectiveSettings

    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, v, heads = a["hidden"], a["vocab"], max(1, a["hidden"] // 64)
    base = dict(hidden_size=h, intermediate_size=3 * h, num_layers=a["layers"], num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2) if heads % 2 == 0 else heads, head_dim=64 if h >= 64 else h,
                vocab_size=v, num_target_layers=8, target_layer_ids=[1, 4, 6], mask_token_id=v - 1,
                block_size=a["block"], rope_theta=10000.0)
    cfg = DFlash2Config(**base, selector_rank=a["rank"], selector_top_k=a["top_k"]) if kind == "dflash2" \
        else DrafterConfig(**base)
    drafter = build_drafter(cfg)
    embed = torch.nn.Embedding(v, h).requires_grad_(False)
    head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    objective = for_drafter(ObjectiveSettings(), drafter)
    for term in objective.terms:
        term.at(1.0)  # the selector's loss at its full weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v - 1, (a["batch"], a["tokens"]), generator=g)
    hidden = torch.randn(a["batch"], a["tokens"], 3 * h, generator=g)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    spans: dict[str, float] = {}

    @contextmanager
    def span(category: str):
        t0 = time.perf_counter()
        yield
        spans[category] = spans.get(category, 0.0) + time.perf_counter() - t0

    times, selector = [], []
    for i in range(a["steps"] + 1):
        plan = plan_blocks(ids, loss_mask, a["block"], a["anchors"], g)
        spans.clear()
        t0 = time.perf_counter()
        out = objective(drafter, embed, head, ids, hidden, plan, span=span)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up (allocations, the optimizer's state)
            times.append(time.perf_counter() - t0)
            selector.append(spans.get("selector", 0.0))
    codebooks = sum(p.numel() for n, p in drafter.named_parameters() if "codebook" in n)
    return {"step_ms": statistics.median(times) * 1e3, "selector_ms": statistics.median(selector) * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params_m": sum(p.numel() for p in drafter.parameters()) / 1e6, "codebook_params_m": codebooks / 1e6}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":  # a child: one drafter kind, settings as JSON
        kind, a = sys.argv[2].split(":", 1)
        print(json.dumps(one(kind, json.loads(a))))
        return
    args = bench_args(__doc__, OPTIONS, QUICK)
    settings = {k: getattr(args, k) for k in OPTIONS}
    results = {}
    with ForeignLoad() as load:
        for kind in ("dflash", "dflash2"):
            r = subprocess.run([sys.executable, str(Path(__file__)), "--one", f"{kind}:{json.dumps(settings)}"],
                               capture_output=True, text=True, check=False)
            if r.returncode:
                raise SystemExit(f"the {kind} step failed: {r.stderr[-2000:]}")
            results[kind] = json.loads(r.stdout)
    d1, d2 = results["dflash"], results["dflash2"]
    report = {
        "dflash_step_ms": round(d1["step_ms"], 1), "dflash2_step_ms": round(d2["step_ms"], 1),
        "dflash2_vs_dflash_step": round(d2["step_ms"] / d1["step_ms"], 2),
        "selector_share_of_dflash2_step": round(d2["selector_ms"] / d2["step_ms"], 3),
        "dflash_peak_rss_mb": round(d1["peak_rss_mb"]), "dflash2_peak_rss_mb": round(d2["peak_rss_mb"]),
        "dflash_params_m": round(d1["params_m"], 2), "dflash2_params_m": round(d2["params_m"], 2),
        # fp32 weights + gradient + AdamW's two moments: 16 bytes per parameter
        "codebooks_with_adamw_mb": round(d2["codebook_params_m"] * 16, 1),
        **settings, "torch_threads": 1,
        "foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2,
    }
    print_report(report, args.json)


if __name__ == "__main__":
    main()
