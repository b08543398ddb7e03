"""Benchmark: the cost per verify round of each way to roll the target's cache back, on a hybrid
(Gated DeltaNet + full attention, Qwen3.5) and a sliding-window (gpt-oss) target.

After a verify forward the target's cache holds the whole block; a round keeps the anchor and the
accepted drafts (dflash/eval/verifier.py says how each kind of layer is rolled back). Each way is run on
the same decode: a random-weight target from transformers' own config class (dflash/targets/families.py),
drafts taken from the target's own greedy output and made wrong at a planned slot, so every way sees the
same acceptances (geometric, each slot kept with probability `--keep`, like a drafter with tau ~3). Per
round: the verify forward and the rollback (`commit`) timed apart, medians; the extra forwards; and
whether the committed tokens stayed the target's greedy output (exact). The verifier refuses `record` on
the hybrid target where transformers cannot restore the recurrent state by cropping (before 5.25;
`records_recurrent_states` says which) and `mixers` on the sliding one (it has no linear-attention
mixers); both are reported so. Torch runs one intra-op thread (set here).

    python scripts/bench_rollback.py [--json] [--quick] [--tokens 256] [--block 16] [--layers 8]
                                     [--scale 4] [--window 64] [--keep 0.7]
"""

from __future__ import annotations

import random
import statistics
import time

from _bench import ForeignLoad, bench_args, print_report

TARGETS = {"hybrid": "qwen3_5", "sliding": "gpt_oss"}
PROMPT = 32
VOCAB = 512


def decode(target, reference: list[int], prompt: list[int], plan: list[int], block: int, rollback: str) -> dict:
    """One speculative decode driven by ``plan`` (drafts accepted per round) with one rollback way."""
    import torch

    from dflash.eval.verifier import CachedVerifier

    v = CachedVerifier(target, rollback, hidden=False)
    try:
        seq = [int(v.prefill(prompt).logits[-1].argmax())]
    except ValueError as e:
        return {"refused": str(e)}
    verify_s, commit_s = [], []
    exact = True
    for want in plan:
        drafts = list(reference[len(seq): len(seq) + block - 1])
        if len(drafts) < block - 1:
            break
        if want < block - 1:
            drafts[want] = (drafts[want] + 1) % VOCAB
        tokens = torch.tensor([seq[-1], *drafts])
        t0 = time.perf_counter()
        posterior = v.verify(tokens).logits.argmax(-1)
        t1 = time.perf_counter()
        accepted = int((tokens[1:] == posterior[:-1]).int().cumprod(0).sum())
        seq += drafts[:accepted] + [int(posterior[accepted])]
        v.commit(accepted + 1)
        commit_s.append(time.perf_counter() - t1)
        verify_s.append(t1 - t0)
        exact = exact and seq == reference[: len(seq)]
    rounds = len(verify_s)
    return {"rounds": rounds, "tokens": len(seq), "exact": exact,
            "verify_ms": round(statistics.median(verify_s) * 1e3, 3),
            "rollback_ms": round(statistics.median(commit_s) * 1e3, 3),
            "round_ms": round((sum(verify_s) + sum(commit_s)) / rounds * 1e3, 3),
            "extra_forwards": v.forwards - 1 - rounds}


#: the command line: name -> (default, help)
OPTIONS = {"tokens": (256, "tokens decoded per way"), "block": (16, "block size"), "layers": (8, "target layers"),
           "scale": (4, "target width: hidden 64 x scale"), "window": (64, "the sliding target's window"),
           "keep": (0.7, "chance each next draft is accepted")}


def main() -> None:
    args = bench_args(__doc__, OPTIONS, ("a small target and a short decode (a smoke run)",
                                         dict(tokens=40, block=4, layers=4, scale=1, window=6)))
    import torch

    from dflash.eval.speculative import greedy_generate
    from dflash.eval.verifier import ROLLBACKS, new_cache, records_recurrent_states
    from dflash.targets.families import family_model
    from dflash.targets.hf import HFTarget

    torch.set_num_threads(1)
    rng = random.Random(0)
    plan = []
    for _ in range(args.tokens):
        n = 0
        while n < args.block - 1 and rng.random() < args.keep:
            n += 1
        plan.append(n)
    report: dict = {"tokens": args.tokens, "block": args.block, "layers": args.layers, "hidden": 64 * args.scale,
                    "window": args.window, "keep": args.keep,
                    "planned_tau": round(sum(plan) / len(plan) + 1, 2)}
    with ForeignLoad() as load:
        for kind, family in TARGETS.items():
            model = family_model(family, VOCAB, layers=args.layers, scale=args.scale, sliding_window=args.window)
            target = HFTarget(model, None, [0])
            prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
            reference = greedy_generate(target, prompt, args.tokens + args.block, stop_token_ids=[])
            decode(target, reference, prompt, plan[:3], args.block, "reprefill")  # warm-up
            report[f"{kind}_family"] = family
            report[f"{kind}_records_recurrent_states"] = records_recurrent_states(new_cache(model))
            for way in ROLLBACKS:
                result = decode(target, reference, prompt, plan, args.block, way)
                report.update({f"{kind}_{way}_{k}": v for k, v in result.items()})
    report.update({"foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2})
    print_report(report, args.json)


if __name__ == "__main__":
    main()
