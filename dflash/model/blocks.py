"""The blocks a drafter trains on: random anchors, packed blocks, the block attention mask, the
drafter's pass over them, and the acceptance metrics. The losses on top are dflash/objectives/.

One training sequence of T tokens (with the target's tap-layer hidden states for every position) yields
up to ``num_anchors`` blocks. For an anchor at position ``a``:

    block tokens  [x[a], MASK, MASK, ..., MASK]          (B slots, positions a .. a+B-1)
    labels        slot k (1 <= k < B) predicts x[a+k]    (slot 0 is the given anchor token)
    visible       context positions j < a (target hidden states strictly *before* the anchor),
                  every slot of the same block (bidirectional), nothing of any other block

This mirrors decoding exactly: after the target has verified up to position a-1 and produced token x[a]
from its last logits, the drafter gets the target's hidden states for positions < a and the block
[x[a], MASK, ...] at positions a.., and must fill x[a+1], x[a+2], ... The two bugs public trainers had
(a label offset of one; context at or after the anchor leaking in) both yield near-perfect *training*
accuracy and useless drafts; tests/test_model_blocks.py pins both.

All blocks of a sequence are packed into one drafter pass: queries are the N*B block slots, keys are
[T context positions ; N*B block slots], and the mask above is built explicitly (SDPA, CPU) or as a
FlexAttention BlockMask from tile metadata (CUDA; masks.py); sliding-window layers get their own mask
(the window of masks.py), full-attention layers the one above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from dflash.model.drafter import SLIDING, DFlashDrafter
from dflash.model.masks import block_attention_mask, flex_block_mask, use_flex


@dataclass
class LossOutput:
    """The loss plus the step's metrics, as device tensors and host counts.

    Nothing here is read back from the device during a training step (a read would block the worker
    until the GPU drains): ``stats`` stays on the device and the trainer sums it over a log interval
    and reads it once (dflash/train/device/metrics.py). The properties below read it at once; they are for
    tests and one-off use.

    stats: float32 ``[loss, sum over blocks of the run of leading correct slots, correct slot 1 ..
        correct slot B-1, term 1 .. term m, metric 1 .. metric j]`` (the totals ``metrics_of`` turns
        into rates, then each term of the objective before its weight, named by ``term_names``, then the
        rates the terms measure, named by ``metric_names``: a DFlash2 selector's recall and accuracy).
    per_position_count[k-1]: supervised slots at position k (host ints, known from the batch plan).
    """

    loss: torch.Tensor
    stats: torch.Tensor
    num_blocks: int
    per_position_count: list[int] = field(default_factory=list)
    term_names: tuple[str, ...] = ()
    metric_names: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.per_position_count)

    def metrics(self) -> dict[str, float | list[float]]:
        """accuracy, per_position_acc, sim_tau, block_tau of this step (reads the device)."""
        values = self.stats.detach().double().cpu().tolist()
        return metrics_of(values[1], values[2:2 + len(self.per_position_count)], self.per_position_count,
                          self.num_blocks)

    def terms(self) -> dict[str, float]:
        """Each term of the objective on this step, before its weight (reads the device)."""
        values = self.stats.detach().double().cpu().tolist()[2 + len(self.per_position_count):]
        return dict(zip(self.term_names, values[:len(self.term_names)], strict=True))

    def term_metrics(self) -> dict[str, float]:
        """The rates the terms measured on this step, by name (reads the device)."""
        values = self.stats.detach().double().cpu().tolist()[2 + len(self.per_position_count) + len(self.term_names):]
        return dict(zip(self.metric_names, values, strict=True))

    @property
    def accuracy(self) -> float:
        return self.metrics()["accuracy"]  # type: ignore[return-value]

    @property
    def per_position_acc(self) -> list[float]:
        return self.metrics()["per_position_acc"]  # type: ignore[return-value]

    @property
    def sim_tau(self) -> float:
        return self.metrics()["sim_tau"]  # type: ignore[return-value]

    @property
    def block_tau(self) -> float:
        return self.metrics()["block_tau"]  # type: ignore[return-value]


def metrics_of(run_sum: float, correct: Sequence[float], counts: Sequence[float],
               blocks: float) -> dict[str, float | list[float]]:
    """Acceptance metrics from totals over one step or many (pooled, so a log interval's figure weighs
    every supervised slot alike).

    per_position_acc[k-1]: top-1 accuracy of slot k over supervised slots (k = 1..B-1).
    sim_tau: simulated acceptance length ``1 + sum_k prod_{j<=k} acc_j`` (the expected tokens per
        verify round if slot errors were independent; the leading 1 is the target's own bonus token).
        Teacher-forced and optimistic: real decoding (dflash eval) is the number to trust.
    block_tau: ``1 + mean over blocks of the run of leading correct slots``: the acceptance each
        training block would actually have had, with no independence assumption.
    """
    per_pos = [c / n if n else 0.0 for c, n in zip(correct, counts, strict=True)]
    tokens = sum(counts)
    return {
        "accuracy": sum(correct) / tokens if tokens else 0.0,
        "per_position_acc": per_pos,
        "sim_tau": 1.0 + sum(math.prod(per_pos[: k + 1]) for k in range(len(per_pos))),
        "block_tau": 1.0 + run_sum / blocks if blocks else 1.0,
    }


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence: positions a with loss_mask[a] on and a + B - 1 < T (a full block
    fits), drawn without replacement, up to ``num_anchors`` (all valid positions if fewer), sorted.

    Returns (anchors [Bsz, N] long, keep [Bsz, N] bool); N is the largest count in the batch and rows
    with fewer anchors are padded (keep False, anchor 0). Vectorised: every position gets a uniform
    random key, invalid ones the key 2, and the N smallest keys of a row are a uniform sample of its
    valid positions. Meant for the host (the trainer's batch producer): N is read from the mask, and
    ``generator`` (a CPU generator, which makes the draw reproducible) needs a CPU mask.
    """
    bsz, t = loss_mask.shape
    valid = loss_mask.bool().clone()
    valid[:, max(0, t - block_size + 1):] = False
    n = min(num_anchors, int(valid.sum(1).max())) if valid.numel() else 0
    keys = torch.rand(bsz, t, generator=generator, device=valid.device).masked_fill_(~valid, 2.0)
    picked = keys.topk(n, dim=1, largest=False).indices
    # Order the kept positions ascending and push padding (positions + t) past them.
    order = torch.where(valid.gather(1, picked), picked, picked + t).sort(dim=1).values
    keep = order < t
    return torch.where(keep, order, 0), keep


@dataclass
class BlockPlan:
    """Which blocks a batch trains on and which of their slots are supervised, built on the host.

    Every data-dependent shape of the objective (how many anchors, which slots have a label in the
    response) is settled here from the CPU batch, so the device step needs no ``nonzero``, boolean
    indexing or count read, each of which would block the worker until the GPU drains. The tensors are
    views of one buffer: pinned and moved in one non-blocking copy.

    anchors [Bsz, N]: anchor positions, -1 for padding. sel [S]: flat index into [Bsz, N, B-1] of the
    supervised slots; labels [S]: their tokens x[a + k]; slot [S]: k - 1.
    """

    buffer: torch.Tensor
    shape: tuple[int, int]  # (Bsz, N)
    num_blocks: int
    per_position_count: list[int]

    def _part(self, i: int) -> torch.Tensor:
        a = self.shape[0] * self.shape[1]
        s = self.num_tokens
        bounds = (0, a, a + s, a + 2 * s, a + 3 * s)
        return self.buffer[bounds[i]:bounds[i + 1]]

    @property
    def num_tokens(self) -> int:
        return sum(self.per_position_count)

    @property
    def anchors(self) -> torch.Tensor:
        return self._part(0).view(self.shape)

    @property
    def sel(self) -> torch.Tensor:
        return self._part(1)

    @property
    def labels(self) -> torch.Tensor:
        return self._part(2)

    @property
    def slot(self) -> torch.Tensor:
        return self._part(3)

    def pin_memory(self) -> BlockPlan:
        return replace(self, buffer=self.buffer.pin_memory())

    def to(self, device: torch.device) -> BlockPlan:
        """On ``device`` (non-blocking: pin first for a truly asynchronous host-to-device copy)."""
        return replace(self, buffer=self.buffer.to(device, non_blocking=True))


def plan_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockPlan:
    """The BlockPlan of a (host) batch: sampled anchors, or the given (anchors, keep).

    A slot k of the block at anchor a is supervised iff the block is kept and loss_mask[a + k] is on;
    its label is input_ids[a + k].
    """
    if anchors is None:
        anchors, keep = sample_anchors(loss_mask, block_size, num_anchors, generator)
    else:
        anchors, keep = anchors[0].long(), anchors[1].bool()
    bsz, n = anchors.shape
    t = input_ids.shape[1]
    label_pos = (anchors[:, :, None] + torch.arange(1, block_size)).clamp(max=max(t - 1, 0)).view(bsz, -1)
    supervised = keep[:, :, None] & loss_mask.bool().gather(1, label_pos).view(bsz, n, block_size - 1)
    sel = supervised.flatten().nonzero().flatten()
    slot = sel % (block_size - 1)
    buffer = torch.cat([torch.where(keep, anchors, -1).flatten(), sel,
                        input_ids.gather(1, label_pos).flatten()[sel], slot])
    return BlockPlan(buffer, (bsz, n), int(keep.sum()), torch.bincount(slot, minlength=block_size - 1).tolist())


def build_blocks(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens, positions and label positions for packed blocks.

    Returns block_ids [Bsz, N*B] (anchor token then MASKs), positions [Bsz, N*B] (a + k), and
    label_pos [Bsz, N, B-1]: slot k of the block at anchor a is labelled with input_ids[a + k].
    """
    bsz, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets  # [Bsz, N, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return block_ids.view(bsz, n * block_size), positions.view(bsz, n * block_size), positions[:, :, 1:]


def forward_blocks(drafter: DFlashDrafter, embed_tokens: torch.nn.Module, input_ids: torch.Tensor,
                   target_hidden: torch.Tensor, anchors: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   attn_backend: str = "auto") -> torch.Tensor:
    """Drafter hidden states [Bsz, N, B, H] for the blocks at ``anchors`` [Bsz, N], all in one pass."""
    return run_blocks(drafter, embed_tokens, input_ids, target_hidden, anchors, attention_mask, attn_backend)[0]


def run_blocks(
    drafter: DFlashDrafter,
    embed_tokens: torch.nn.Module,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    anchors: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    attn_backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``forward_blocks``' states and whatever else the drafter's forward returned: a drafter returns
    its final states, or a mapping with them under ``"hidden"`` beside its other outputs (extra heads,
    read by the objective's terms: dflash.objectives.base.Forward.extras)."""
    bs = drafter.config.block_size
    bsz, t = input_ids.shape
    n = anchors.shape[1]
    device = input_ids.device
    block_ids, positions, _ = build_blocks(input_ids, anchors, bs, drafter.config.mask_token_id)
    backend = attn_backend if attn_backend != "auto" else ("flex" if use_flex(device) else "sdpa")
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"attn_backend must be auto, sdpa or flex (got {attn_backend!r})")
    build = flex_block_mask if backend == "flex" else block_attention_mask
    # one mask per kind of layer: full attention, and the sliding window if any layer slides
    cfg = drafter.config
    masks = {kind: build(anchors, bs, t, attention_mask, window=cfg.sliding_window if kind == SLIDING else None)
             for kind in dict.fromkeys(cfg.layer_types)}
    with torch.no_grad():
        noise = embed_tokens(block_ids)
    ctx_positions = torch.arange(t, device=device).expand(bsz, t)
    # every position of the pass is below t: the length dynamic RoPE scales by, known without a read
    out = drafter(noise, target_hidden, positions, ctx_positions, masks, seq_len=t, block_len=bs)  # [Bsz, N*B, H]
    extras: dict[str, torch.Tensor] = {}
    if not isinstance(out, torch.Tensor):
        extras = {k: v for k, v in out.items() if k != "hidden"}
        out = out["hidden"]
    return out.view(bsz, n, bs, -1), extras


def predecessors(input_ids: torch.Tensor, anchors: torch.Tensor, sel: torch.Tensor, slot: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The data's token before each supervised slot's label: slot k of the block at anchor a is labelled
    x[a + k], so its predecessor is x[a + k - 1] (``slot`` holds k - 1). ``anchors`` [Bsz, N] and
    ``sel`` [S] as in a BlockPlan; computed on the device."""
    t, n = input_ids.shape[1], anchors.shape[1]
    block = torch.div(sel, block_size - 1, rounding_mode="floor")  # flat block index b * N + j
    anchor = anchors.reshape(-1)[block].clamp(min=0)
    row = torch.div(block, n, rounding_mode="floor")
    return input_ids.reshape(-1)[row * t + anchor + slot]
