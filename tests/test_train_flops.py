"""The step's model FLOPs (dflash/train/device/flops.py) held to torch's own FlopCounterMode on real work:
drafter training steps (DFlash with a sliding-window layer under ``ce``; DFlash2 with its convolutions
and selector under ``kl``) and target forwards (the shipped tiny Qwen3; a Qwen3 with sliding layers; a
GLM-4-MoE-shaped mixture of experts), each row of a padded batch run alone, to the FLOP.

What the counter counts that the count does not, added to the count before comparing, each figure
taken from the real masks rather than from the formula under test:

* **Masked-out attention pairs.** SDPA's math kernel multiplies every query with every key and masks
  the scores afterwards, and the counter counts that whole product; the count takes only the pairs the
  mask lets a query see (the model's work). The masked pairs are counted from the dense masks the step
  itself builds (``block_attention_mask``), and the causal triangle's complement for the target. Forward
  and backward of a pair are 2 + 4 multiplies of ``heads x head_dim`` (the math kernel's backward is
  plain autograd through its two matmuls: no recomputation, which the counter's formula for fused
  kernels would add).
* **Nothing for MoE experts.** The counter has no formula for ``aten._grouped_mm`` (transformers runs a
  MoE layer's experts in one), so it would count them as 0; the test gives it the plain one: every
  routed row through its expert's matrix.
* **Padding.** A batch's shorter rows are padded, its rows with fewer anchors get padding blocks; the
  step computes both, the count does not. So the counter runs each row alone, unpadded, and the rows'
  counts add up to the batch's count.

Math SDPA is forced: on the host torch picks its flash kernel, which the counter has no formula for
(it would count attention as 0). The counter's module tracker is swapped for a global one: it hooks
every module's inputs for backward, and ``torch.autograd.grad`` on the leaf that dflash's chunked LM
head (objectives/head.py) takes each chunk's gradient from is rejected under those hooks. Its counting
(the registry of per-op formulas) is torch's, untouched. Left out by both, and so by neither: norms,
RoPE, softmax, losses, the optimizer (no matrix multiply).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_model_helpers import one_thread  # noqa: F401
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from dflash.model.blocks import plan_blocks
from dflash.model.dflash2 import DFlash2Config, build_drafter
from dflash.model.drafter import SLIDING, DrafterConfig
from dflash.model.masks import block_attention_mask
from dflash.objectives import for_drafter
from dflash.targets.heads import NormedHead
from dflash.telemetry import ProfileStats
from dflash.telemetry.wire.vocab import Gauge
from dflash.train.config.schema import make_config
from dflash.train.device.flops import (
    FlopCount,
    FlopCountError,
    Utilisation,
    causal_pairs,
    devices_peak,
    peak_tflops,
)
from dflash.train.run.stages import Batch, DrafterStage, HiddenBatch

pytestmark = pytest.mark.usefixtures("one_thread")
H, VOCAB, B, WINDOW = 64, 512, 8, 20


class _Global:
    """FlopCounterMode's module tracker, replaced: every op counts under "Global" (see the docstring)."""

    parents = {"Global"}

    def __enter__(self) -> _Global:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A MoE layer's experts in one grouped matmul (transformers' default): the routed rows [M, K] (each
    token once per expert it is routed to), each through its expert's [K, N] matrix."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def counted(run: Callable[[], object]) -> int:
    """The FLOPs torch's FlopCounterMode counts while ``run()`` runs, attention on SDPA's math kernel."""
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    counter = FlopCounterMode(display=False, custom_mapping={grouped: _grouped_mm} if grouped is not None else None)
    counter.mod_tracker = _Global()
    with sdpa_kernel(SDPBackend.MATH), counter:
        run()
    return counter.get_total_flops()


class _AttentionPairs(TorchFunctionMode):
    """Every SDPA call's (query, key) pairs, all of them and those its mask lets through, per batch row
    and head: read from the mask (or ``is_causal``) the model really passed."""

    def __init__(self) -> None:
        super().__init__()
        self.computed = self.visible = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            mask, causal = kwargs.get("attn_mask"), kwargs.get("is_causal", False)
            rows, heads, n_q, n_k = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
            self.computed += rows * heads * n_q * n_k
            if mask is not None:
                seen = mask if mask.dtype == torch.bool else mask == 0  # additive float mask: 0 where seen
                self.visible += heads * int(seen.expand(rows, 1, n_q, n_k).sum())
            elif causal:
                self.visible += rows * heads * int(torch.ones(n_q, n_k).tril(n_k - n_q).sum())
            else:
                self.visible += rows * heads * n_q * n_k
        return func(*args, **kwargs)


def _drafter(kind: str):
    common = dict(hidden_size=H, intermediate_size=3 * H, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=VOCAB, num_target_layers=4, target_layer_ids=[1, 2], block_size=B)
    if kind == "dflash2":
        return DFlash2Config(**common, conv_group_size=16, selector_rank=8, selector_top_k=4)
    return DrafterConfig(**common, layer_types=["full_attention", SLIDING], sliding_window=WINDOW)


def _stage(dcfg, loss: str) -> DrafterStage:
    torch.manual_seed(0)
    drafter = build_drafter(dcfg)
    embed = torch.nn.Embedding(VOCAB, H).requires_grad_(False)
    head = torch.nn.Linear(H, VOCAB, bias=False).requires_grad_(False)
    cfg = make_config({}, dict(max_steps=1, loss=loss))
    objective = for_drafter(cfg.objective, drafter)
    verifier = NormedHead(torch.nn.Identity(), head) if objective.needs_verifier else None
    return DrafterStage(drafter, embed, head, torch.device("cpu"), ProfileStats().worker("drafter-0"),
                        torch.Generator(), optim=cfg.optim, num_anchors=8, nonfinite_limit=3, objective=objective,
                        verifier_head=verifier)


def _batch(ids: torch.Tensor, lengths: list[int], anchors: list[list[int]]) -> Batch:
    """A right-padded batch of rows of ``lengths`` real tokens (loss on every one), with the blocks at
    ``anchors`` (one list per row; a shorter list gets padding blocks)."""
    rows, width = len(lengths), max(lengths)
    attn = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        attn[r, :n] = 1
    n = max(len(a) for a in anchors)
    at = torch.tensor([a + [0] * (n - len(a)) for a in anchors])
    keep = torch.tensor([[i < len(a) for i in range(n)] for a in anchors])
    plan = plan_blocks(ids[:, :width], attn.bool(), B, n, anchors=(at, keep))
    return Batch(0, ids[:, :width], attn, attn.bool(), sum(lengths), plan)


def _masked_pairs(dcfg, batch: Batch) -> int:
    """Pairs the dense attention of ``batch``'s step computes that its masks hide, over the layers."""
    anchors, t = batch.plan.anchors.clamp(min=0), batch.input_ids.shape[1]
    out = 0
    for kind in dcfg.layer_types:
        mask = block_attention_mask(anchors, B, t, batch.attention_mask,
                                    window=dcfg.sliding_window if kind == SLIDING else None)
        out += mask.numel() - int(mask.sum())
    return out


@pytest.mark.parametrize("kind,loss", [("dflash", "ce"), ("dflash2", "kl")])
def test_a_drafter_step_counts_what_torchs_flop_counter_counts(kind: str, loss: str) -> None:
    """A padded batch of two rows (96 and 60 tokens; 6 and 3 blocks, so the second has 3 padding blocks):
    its count equals the counter's over each row's step alone, less the masked pairs, to the FLOP; and it
    is less than what the counter sees the padded step compute."""
    dcfg = _drafter(kind)
    stage = _stage(dcfg, loss)
    count = FlopCount.for_run(dcfg, _NoTarget(), stage.objective)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 96), generator=gen)
    taps = (2 + stage.objective.needs_verifier) * H
    hidden = torch.randn(2, 96, taps, generator=gen)
    lengths, anchors = [96, 60], [[0, 9, 20, 41, 70, 87], [5, 30, 51]]
    per_pair = 3 * 4 * dcfg.num_attention_heads * dcfg.head_dim  # forward 2 matmuls of a pair, backward 4

    expected = 0
    for r in range(2):
        alone = _batch(ids[r:r + 1], lengths[r:r + 1], anchors[r:r + 1])
        hb = HiddenBatch(alone, hidden[r:r + 1, :lengths[r]])
        expected += counted(lambda hb=hb: stage.step(hb, 0.5)) - per_pair * _masked_pairs(dcfg, alone)
    batch = _batch(ids, lengths, anchors)
    ours = count.of_batch(batch)
    assert ours.target == 0 and ours.head > 0 and ours.drafter > 0
    assert ours.total == pytest.approx(expected, rel=1e-12, abs=0), (ours, expected)
    padded = counted(lambda: stage.step(HiddenBatch(batch, hidden), 0.5)) - per_pair * _masked_pairs(dcfg, batch)
    assert padded > ours.total  # the padding and the padding blocks: computed, not counted


class _NoTarget:
    """A target whose states are read, not computed (a cache): no target forward in the step."""

    computes = False
    config = None


def _sliding_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.targets.hf import HFTarget

    cfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, use_sliding_window=True,
                      sliding_window=12, layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    return HFTarget(Qwen3ForCausalLM(cfg).eval().requires_grad_(False), None, [1, 2])


def _tiny():
    from dflash.targets import load_target

    return load_target("tiny")


def _moe():
    """GLM-4-MoE's shape: a dense first layer, then 2 of 4 routed experts and a shared one per token."""
    from dflash.targets.families import family_model
    from dflash.targets.hf import HFTarget

    return HFTarget(family_model("glm4_moe", VOCAB), None, [1, 2])


@pytest.mark.parametrize("make", [_tiny, _sliding_qwen3, _moe], ids=["tiny-qwen3", "qwen3-sliding", "glm4-moe"])
def test_a_target_forward_counts_what_torchs_flop_counter_counts(make) -> None:
    """The target's part of a padded batch (rows of 40 and 23 tokens) equals the counter's over each row's
    forward alone, less the pairs the math kernel computes and the model's own masks hide (causal, and
    the window of sliding layers): those masks are read from the model's SDPA calls."""
    target = make()
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dcfg = DrafterConfig.for_target(cfg, num_layers=1, target_layer_ids=target.layer_ids, mask_token_id=1)
    count = FlopCount(dcfg, cfg)
    lengths = [40, 23]
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = 0
    for row, n in enumerate(lengths):
        pairs = _AttentionPairs()
        with pairs:
            flops = counted(lambda row=row, n=n: target.tap_states(ids[row:row + 1, :n]))
        assert 0 < pairs.visible < pairs.computed
        expected += flops - 4 * head_dim * (pairs.computed - pairs.visible)  # a pair's two matmuls, per head
    ours = count.step(lengths, [], 0)
    assert ours.target == pytest.approx(expected, rel=1e-12, abs=0), (ours.target, expected)


def test_causal_pairs_are_what_a_windowed_causal_mask_lets_through() -> None:
    for n in (1, 5, 12, 13, 40):
        for w in (None, 1, 4, 12):
            q, k = torch.arange(n)[:, None], torch.arange(n)[None]
            mask = (k <= q) & ((k > q - w) if w is not None else True)
            assert causal_pairs(n, w) == int(mask.sum()), (n, w)


def test_a_target_the_count_does_not_know_is_refused_in_one_line() -> None:
    """Gated DeltaNet layers, multi-head latent attention: no made-up figure, the reason instead."""
    from dflash.targets.families import family_config

    with pytest.raises(FlopCountError, match="linear_attention layers are not counted"):
        FlopCount(_drafter("dflash"), family_config("qwen3_5", VOCAB))
    with pytest.raises(FlopCountError, match="latent attention"):
        FlopCount(_drafter("dflash"), family_config("deepseek_v3", VOCAB))


def test_the_peak_is_the_gpus_dense_bf16_one_and_none_where_unknown() -> None:
    assert peak_tflops("NVIDIA H200") == 989 and peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert peak_tflops("NVIDIA H100 PCIe") == 756 and peak_tflops("NVIDIA H100 NVL") == 835
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312 and peak_tflops("NVIDIA A100 80GB PCIe") == 312
    assert peak_tflops("NVIDIA L4") == 121 and peak_tflops("NVIDIA L40S") == 362
    assert peak_tflops("NVIDIA L40") is None and peak_tflops("NVIDIA GeForce RTX 3090") is None
    peak, why = devices_peak([torch.device("cpu")])
    assert peak is None and why == "no peak for cpu"


def test_the_gauges_are_the_rate_over_the_last_ten_seconds_and_mfu_only_with_a_peak() -> None:
    """One reading per telemetry interval (1 s); a step of 40 TFLOP every 2 s: 20 TFLOP/s from every
    reading once 10 s have passed, where one interval alone would read 0 and 40 in turn; no gauge before
    the first step."""
    on_gpu, on_cpu = Utilisation(peak=100e12), Utilisation(peak=None)
    total = 0.0
    for t in range(31):
        if t and t % 2 == 0:
            total += 40e12
        gauges, host = on_gpu.gauges(float(t), total), on_cpu.gauges(float(t), total)
        if t < 2:
            assert gauges == {} and host == {}, t
        elif t >= 10:
            assert gauges[Gauge.TFLOPS] == pytest.approx(20), t
    assert gauges[Gauge.MFU] == pytest.approx(0.2) and gauges[Gauge.PEAK_TFLOPS] == 100
    assert set(host) == {Gauge.TFLOPS} and host[Gauge.TFLOPS] == pytest.approx(20)
    # steps made before the first reading count from the start given: a run shorter than one telemetry
    # interval (all its FLOPs done by the first reading) read 0 without it
    quick = Utilisation(peak=None, start=(0.0, 0.0))
    assert quick.gauges(0.5, 12e12)[Gauge.TFLOPS] == pytest.approx(24)
    assert Utilisation(peak=None).gauges(0.5, 12e12) == {}  # no start: nothing to measure from yet
    assert Utilisation(peak=100e12).text(20e12) == "20 TFLOP/s MFU 20.0%"
    assert Utilisation(peak=None).text(2.13e10) == "0.0213 TFLOP/s MFU n/a"
    assert Utilisation(peak=989e12).text(407.4e12) == "407 TFLOP/s MFU 41.2%"
