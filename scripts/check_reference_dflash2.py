"""Our DFlash2 export read by the public reference's own code: no missing or unexpected keys, the same
forward, the same greedy proposals and the same sampling probabilities, and (with the tiny target)
the same greedy decode from the reference's `dflash_generate` as from `dflash eval`.

The reference (z-lab/dflash `dflash/model.py`) is not part of this repository and its distribution,
also called `dflash`, cannot share our environment: save that one file outside the repository and
name it. It is imported by path with this environment's torch and transformers.

    python scripts/check_reference_dflash2.py --reference /tmp/refenv/model.py

Exits 0 when everything agrees, 1 with the first disagreement.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash.model.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.model.write_export import export_drafter


def load_reference(path: Path):
    spec = importlib.util.spec_from_file_location("reference_dflash_model", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scrambled(cfg: DFlash2Config, seed: int) -> DFlash2Drafter:
    """A drafter whose every weight is random (not the identity convolution, not a zero codebook), so a
    dropped, swapped or mis-shaped piece changes the outputs."""
    torch.manual_seed(seed)
    d = DFlash2Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name or "base_kernel" in name else 0.1))
            if "norm" in name or "base_kernel" in name:
                p.add_(1.0)
    return d.eval()


def compare(what: str, ours: torch.Tensor, theirs: torch.Tensor, atol: float = 1e-5) -> None:
    diff = (ours.float() - theirs.float()).abs().max().item() if ours.shape == theirs.shape else float("inf")
    ok = diff <= atol
    print(f"{'ok  ' if ok else 'FAIL'} {what}: max |ours - reference| = {diff:.3g} (shapes {tuple(ours.shape)}, "
          f"{tuple(theirs.shape)})")
    if not ok:
        raise SystemExit(1)


def check_model(ref, work: Path) -> None:
    h, v = 64, 97
    cfg = DFlash2Config(hidden_size=h, intermediate_size=96, num_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=v, num_target_layers=8,
                        target_layer_ids=[1, 3, 5], mask_token_id=v - 1, block_size=8, rope_theta=10000.0,
                        conv_kernel_size=3, conv_group_size=16, selector_rank=24, selector_top_k=6)
    ours = scrambled(cfg, 0)
    export_drafter(ours, work)
    theirs, info = ref.DFlash2DraftModel.from_pretrained(str(work), output_loading_info=True, dtype=torch.float32)
    theirs.eval()
    bad = {k: v for k, v in info.items() if v}
    print(f"{'ok  ' if not bad else 'FAIL'} from_pretrained: loading info {info}")
    if bad:
        raise SystemExit(1)
    g = torch.Generator().manual_seed(1)
    ctx_len, bs = 11, cfg.block_size
    noise = torch.randn(1, bs, h, generator=g)
    target_hidden = torch.randn(1, ctx_len, 3 * h, generator=g)
    head = torch.nn.Linear(h, v, bias=False)
    head.weight.data = torch.randn(v, h, generator=g)
    with torch.no_grad():
        mine = ours(noise, target_hidden, torch.arange(ctx_len, ctx_len + bs)[None], torch.arange(ctx_len)[None])
        ref_out = theirs(position_ids=torch.arange(ctx_len + bs)[None], noise_embedding=noise,
                         target_hidden=target_hidden)
        compare("forward (one block after 11 context positions)", mine, ref_out)
        anchor = torch.tensor([5])
        hidden = mine[:, 1:]
        p_ours = ours.propose(hidden, anchor, head)
        p_ref = theirs.propose(hidden, anchor, head, 0.0)
        compare("greedy proposal", p_ours.tokens, p_ref[0], atol=0)
        # at temperature: the same candidate probabilities after the same predecessors (the two walks
        # draw with their own random streams, so compare them given one path: the reference's)
        torch.manual_seed(4)
        tokens, cands, q_ref = theirs.propose(hidden, anchor, head, 0.8)
        unary, cand_ours = ours.candidate_selector.candidates(head(hidden))
        projected = ours.candidate_selector.hidden_projection(hidden)
        previous = torch.cat([anchor[:, None], tokens[:, :-1]], 1)
        q_ours = torch.softmax(ours.candidate_selector.scores(projected, previous, unary, cand_ours) / 0.8, -1)
        order_ref, order_ours = cands.argsort(-1), cand_ours.argsort(-1)  # the reference's top-k is unsorted
        compare("sampling probabilities over the candidates (T=0.8)", q_ours.gather(-1, order_ours),
                q_ref.gather(-1, order_ref))


def check_decode(ref, work: Path, drafter: Path | None) -> None:
    """Both decoders on the tiny target with a DFlash2 drafter: the same tokens and acceptance. A random
    drafter has every draft rejected; a trained one (``drafter``: for the tiny target) has some kept."""
    from dflash.eval.speculative import speculative_generate
    from dflash.model.loading import load_drafter
    from dflash.targets import load_target

    if drafter is not None:
        ours = load_drafter(drafter, torch.float32).eval()
        if not isinstance(ours, DFlash2Drafter):
            raise SystemExit(f"{drafter}: not a DFlash2 drafter")
        target = load_target("tiny", device="cpu", layer_ids=ours.config.target_layer_ids)
    else:
        target = load_target("tiny", device="cpu", layer_ids=[1, 2])
        cfg = DFlash2Config.for_target(target.config, num_layers=1, block_size=6, target_layer_ids=target.layer_ids,
                                       mask_token_id=target.default_mask_token_id())
        ours = scrambled(DFlash2Config(**{**cfg.__dict__, "selector_rank": 16, "selector_top_k": 4,
                                          "conv_group_size": 8}), 2)
    export_drafter(ours, work)
    theirs = ref.DFlash2DraftModel.from_pretrained(str(work), dtype=torch.float32).eval()
    prompt = target.tokenizer("the quick brown fox")["input_ids"]
    mine = speculative_generate(ours, target, prompt, 48, stop_token_ids=[])
    ref._cuda_time = time.perf_counter  # its stats time with CUDA synchronisations; on the CPU a clock will do
    out = ref.dflash_generate(theirs, target.model, torch.tensor([prompt]), 48, None, return_stats=True)
    theirs_tokens = out.output_ids[0, len(prompt):].tolist()
    compare("greedy decode tokens (tiny target, 48 tokens)", torch.tensor(mine.tokens), torch.tensor(theirs_tokens),
            atol=0)
    # the proposals, round by round: the tokens each verify round kept (ours also counts a last round
    # whose tokens all fell past the budget, as 0; the reference stops before it)
    compare("tokens per round", torch.tensor([n for n in mine.produced if n]), torch.tensor(out.acceptance_lengths),
            atol=0)
    print(f"     drafts accepted per round: {mine.accepted}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True, type=Path, help="the reference's dflash/model.py, saved outside "
                   "this repository")
    p.add_argument("--drafter", type=Path, default=None, help="a DFlash2 drafter for the tiny target (run directory, "
                   "checkpoint or export) to decode with; default: a random one")
    args = p.parse_args()
    torch.set_num_threads(1)  # a check, not a benchmark: one thread, so it runs beside other work
    ref = load_reference(args.reference)
    with tempfile.TemporaryDirectory() as tmp:
        check_model(ref, Path(tmp) / "model")
        check_decode(ref, Path(tmp) / "decode", args.drafter)
    print("the reference reads our DFlash2 export and computes what we compute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
