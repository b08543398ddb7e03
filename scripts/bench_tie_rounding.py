"""How far apart bf16 rounding puts the same logits when the verifier computes them two ways.

Speculative decoding's verifier scores a block of tokens in one forward; plain greedy decoding scores
one token per forward. Mathematically the logits are the same; in bf16 the kernels round differently
(a block's matmuls accumulate in another order, attention sees a query block instead of one row), so a
greedy choice between two tokens closer than that difference can go either way. `dflash eval` forgives
a divergence only at such a near-tie, so its tolerance must be no wider than what this measures.

For each model (the built-in tiny target cast to bf16, and a random-weight model of Qwen3's shape: its
0.6B width, heads and MLP, fewer layers so the CPU runs it in a minute), one prompt is prefilled and a
continuation of ``--tokens`` tokens is scored twice with the same KV cache discipline the evaluation
uses (dflash.eval.verifier.CachedVerifier): in blocks of ``--block`` (verification) and one token per
forward (plain decoding). Reported per model: the largest |logit difference| over every position and
vocabulary entry, the same in units of the dtype's eps x max(1, |logit|) (the form `tie_tolerance`
takes), and the largest difference among each position's two highest logits (the pair a greedy choice
is between). One torch thread, so the kernels are the same from run to run.

    python scripts/bench_tie_rounding.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dflash.eval.verifier import CachedVerifier  # noqa: E402
from dflash.targets.hf import cache_kwarg  # noqa: E402


class _Bare:
    """The three things CachedVerifier reads of a target, for a model that is not loaded as one."""

    def __init__(self, model):
        self.model = model
        self.device = torch.device("cpu")
        self.cache_kwarg = cache_kwarg(model)


def qwen3_shaped(layers: int, vocab: int, seed: int):
    """Random weights in Qwen3-0.6B's shape (hidden 1024, 16/8 heads of 128, MLP 3072), ``layers`` deep.
    The LM head is scaled so the logits spread as a trained model's do (largest around 20): rounding
    error grows with the logits' magnitude, and near-uniform random logits would understate it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def logits_both_ways(target, prompt: list[int], cont: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits after each of ``cont``'s tokens [len(cont), V]: (verified in blocks, one token per forward)."""
    blocked = []
    v = CachedVerifier(target, hidden=False)
    v.prefill(prompt)
    for i in range(0, len(cont), block):
        chunk = torch.tensor(cont[i:i + block])
        blocked.append(v.verify(chunk).logits.float())
        v.commit(chunk.shape[0])
    single = []
    v = CachedVerifier(target, hidden=False)
    v.prefill(prompt)
    for t in cont:
        single.append(v.verify(torch.tensor([t])).logits.float())
        v.commit(1)
    return torch.cat(blocked), torch.cat(single)


def measure(name: str, target, vocab: int, dtype: torch.dtype, tokens: int, block: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (48,), generator=g).tolist()
    cont = torch.randint(3, vocab, (tokens,), generator=g).tolist()
    a, b = logits_both_ways(target, prompt, cont, block)
    diff = (a - b).abs()
    eps = torch.finfo(dtype).eps
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=1.0)
    ulps = diff / (eps * scale)
    top2 = b.topk(2, -1).indices  # the pair plain greedy decoding chooses between
    pair_diff = diff.gather(-1, top2)
    # the difference that can flip a choice between two tokens: the gap between them moves by at most
    # the sum of their own two differences
    gap_shift = ((a - b).gather(-1, top2[:, :1]) - (a - b).gather(-1, top2[:, 1:])).abs()
    gap_ulps = gap_shift / (eps * scale.gather(-1, top2).amax(-1, keepdim=True))
    return {
        "model": name, "dtype": str(dtype).removeprefix("torch."), "positions": a.shape[0], "vocab": a.shape[1],
        "max_abs_logit": round(float(b.abs().max()), 3),
        "max_diff": float(diff.max()), "median_diff": float(diff.median()),
        "max_diff_ulps": round(float(ulps.max()), 2), "p999_diff_ulps": round(float(ulps.flatten().quantile(0.999)), 2),
        "max_top2_diff": float(pair_diff.max()),
        "max_top2_gap_shift": float(gap_shift.max()), "max_top2_gap_shift_ulps": round(float(gap_ulps.max()), 2),
        "argmax_flips": int((a.argmax(-1) != b.argmax(-1)).sum()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--qwen3-layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192, help="the Qwen3-shaped model's vocabulary (only its head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # one kernel choice per shape, the same every run
    dtype = torch.bfloat16
    from dflash.targets import load_target

    tiny = load_target("tiny", dtype=dtype)
    rows = [measure("tiny (built-in, bf16)", tiny, tiny.vocab_size, dtype, args.tokens, args.block, args.seed)]
    q = qwen3_shaped(args.qwen3_layers, args.vocab, args.seed).to(dtype)
    rows.append(measure(f"Qwen3-0.6B-shaped x{args.qwen3_layers} layers (random, bf16)", _Bare(q), args.vocab, dtype,
                        args.tokens, args.block, args.seed))
    if args.json:
        print(json.dumps({"block": args.block, "tokens": args.tokens, "models": rows}))
    else:
        for r in rows:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
