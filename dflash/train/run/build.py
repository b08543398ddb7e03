"""What a run is made of: `build` turns a config into the parts the pipeline drives, `restore` puts a
checkpoint's optimizer, RNG and position back into them.

Neither starts a thread, opens a socket or writes a file: the Trainer does that with what they return,
so the wiring of data, targets, drafter and telemetry reads here top to bottom. The target itself is
made before (dflash.targets.make_target), so a caller can hand in any producer of hidden states.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.data import Sample
from dflash.objectives import Objective, for_drafter
from dflash.objectives.optim import describe as describe_optimizer
from dflash.targets import Target, TargetError
from dflash.targets.heads import NormedHead
from dflash.telemetry.wire.vocab import Counter, Gauge, Role
from dflash.train import distributed
from dflash.train.checkpoint import rng
from dflash.train.config import ConfigError, TrainConfig
from dflash.train.config.schema import read_saved
from dflash.train.device.binding import cuda_ordinal, resolve
from dflash.train.device.flops import FlopCount, FlopCountError, devices_peak
from dflash.train.device.memory import RecipeError, size_to_device
from dflash.train.distributed import Dist
from dflash.train.health.faults import FaultPlan
from dflash.train.run.pipeline import TrainCounters
from dflash.train.run.stages import BatchSource, DataPosition, DrafterStage, TargetStage
from dflash.words import plural


class TrainError(RuntimeError):
    """Setup failed in a way the user can fix; the message is one line."""


#: rows of the training data per row held out for evaluation, at most
HELD_OUT_SHARE = 10


@dataclass
class EvalSet:
    """The prompts a run evaluates on, what they are in words (every tau printed says it), and the rows
    held out of training (positions in the run's samples; recorded in the run directory so that a resume
    holds out the same ones)."""

    prompts: list[list[int]]
    what: str  # e.g. "8 held-out rows of --data chats.jsonl"
    held_out: list[int]


@dataclass
class Components:
    """The parts of a run, as `build` made them."""

    target: Target  # the first target replica: its tokenizer reads the data and the evaluation prompts
    verifier: Any  # what evaluates the drafter (an HFTarget: the target itself or --eval-target); None: nothing can
    targets: list[TargetStage]  # one per target worker (one "trainer" stage in sync mode)
    drafter: DrafterStage
    dcfg: Any  # the drafter's DrafterConfig, saved in every checkpoint
    source: BatchSource
    stats: Any  # the ProfileStats every worker reports to
    generator: torch.Generator  # this rank's anchor sampling
    data_path: Path
    samples: int
    evals: EvalSet = field(default_factory=lambda: EvalSet([], "", []))  # the prompts evaluations read
    bad_samples: list[str] = field(default_factory=list)  # a cache's files skipped so far, the line said of each
    peak_flops: float | None = None  # the devices' dense bf16 peak, FLOP/s, that MFU is against (None: no MFU)

    @property
    def drafter_device(self) -> torch.device:
        return self.drafter.device

    def describe(self, cfg: TrainConfig) -> str:
        """The start-of-run line about the target, the drafter and the data."""
        d = self.dcfg
        params = sum(p.numel() for p in self.drafter.drafter.parameters()) / 1e6
        return (f"target {cfg.run.target}: {self.target.describe()}; "
                f"drafter {d.describe_layers()}, {params:.2f}M params, block {d.block_size}, "
                f"mask token {d.mask_token_id}; data {self.data_path} ({self.samples} samples)")


def run_target(cfg: TrainConfig, log: Callable[[str], None] = print, resuming: bool = False) -> Target:
    """The target the settings name, on the first target worker's device (build replicates it). The
    data paths (--data, --eval-data) are checked first: a typo in one should not wait for a large target
    to load; and on a fresh start with --init-from the drafter's shape (its taps among it) is the
    release's where the user set none (a resumed run has its checkpoint's shape, and its saved config says it)."""
    from dflash.data import DataError, resolve_data
    from dflash.data.store import is_store
    from dflash.model.export import DrafterLoadError
    from dflash.targets import make_target
    from dflash.train.config.released import take_release_shape

    try:
        if not is_store(Path(cfg.run.data)):
            resolve_data(cfg.run.data)
        if cfg.eval.eval_data is not None:
            resolve_data(cfg.eval.eval_data, evaluation=True)
        if not resuming and (line := take_release_shape(cfg)):
            log(line)
        return make_target(cfg, resolve(cfg.pipeline.target_devices[0]))
    except (DataError, TargetError, DrafterLoadError, ConfigError) as e:
        raise TrainError(str(e)) from None


def build(cfg: TrainConfig, dist: Dist, target: Target, ckpt: dict | None = None, faults: FaultPlan | None = None,
          log: Callable[[str], None] = print, samples: list[Sample] | None = None,
          event: Callable[..., None] | None = None) -> Components:
    """Make the drafter (from `ckpt`'s shape and weights when resuming) and the stages around `target`
    (the first target worker's, on `cfg.pipeline.target_devices[0]`; the others get replicas of it).
    The data is `samples` when given, else read from `cfg.run.data` with the target's tokenizer.
    `--epochs` becomes `cfg.run.max_steps` here, once an epoch's length is known. `event(kind, line)`:
    how the run tells what happens while it trains (the Reporter's; default: a log line)."""
    from dflash.data import DataError
    from dflash.telemetry import ProfileStats

    samples_given = samples is not None
    try:
        devices = [resolve(d) for d in cfg.pipeline.target_devices]
        drafter_device = resolve(cfg.pipeline.drafter_device)
        replicas = {dev: target.replica(dev) for dev in dict.fromkeys(devices)}  # CPU workers share one
        verifier = evaluator(cfg, replicas[devices[0]], devices[0], log)
        samples, data_path = read_samples(cfg, target, samples, log)
    except (DataError, TargetError) as e:
        raise TrainError(str(e)) from None
    try:
        evals = eval_set(cfg, samples, data_path, target, verifier, resuming=ckpt is not None,
                         given=samples_given)
    except DataError as e:
        raise TrainError(str(e)) from None
    held = set(evals.held_out)
    # an array, not a list: a corpus of millions of rows would make it hundreds of MB of Python ints
    train = np.setdiff1d(np.arange(len(samples)), np.asarray(evals.held_out, dtype=np.int64)) if held else None
    if len(samples) - len(held) < dist.world_size:
        raise TrainError(f"{data_path} has {len(samples) - len(held)} usable samples to train on, fewer than the "
                         f"{dist.world_size} ranks")
    first = replicas[devices[0]]
    tok = target.tokenizer
    pad = 0 if tok is None else tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    model, dcfg = make_drafter(cfg, first, ckpt, log)
    model = model.to(drafter_device)
    # Same drafter init on every rank (DDP also broadcasts rank 0's), different anchors per rank.
    generator = torch.Generator().manual_seed(cfg.data.seed + 1_000_003 * dist.rank)

    stats = ProfileStats(enabled=cfg.telemetry.enabled)
    publish_truncation(stats, samples)
    if cfg.pipeline.enabled:
        stats.worker("batch-producer", Role.DATA)  # registered now so every snapshot lists it
    embed, lm_head = first.frozen_head(drafter_device)
    objective, verifier_head = make_objective(cfg, model, first, lm_head, drafter_device)
    ddp = distributed.wrap_ddp(model, drafter_device, stats, cfg.distributed.bucket_mb) if dist.enabled else None
    worker = (stats.worker("drafter-0", Role.DRAFTER, cuda_ordinal(drafter_device)) if cfg.pipeline.enabled
              else stats.worker("trainer"))
    drafter = DrafterStage(model, embed, lm_head, drafter_device, worker, generator, optim=cfg.optim,
                           num_anchors=cfg.model.num_anchors, nonfinite_limit=cfg.health.nonfinite_limit,
                           objective=objective, ddp=ddp, faults=faults, verifier_head=verifier_head)
    log(f"objective: {objective.describe()}, position weight {cfg.objective.position_weight}; optimizer "
        f"{describe_optimizer(drafter.optimizer)}")
    count, peak = count_flops(dcfg, first, objective,
                              [drafter_device, *(devices if cfg.pipeline.enabled else devices[:1])], log)
    targets = []
    for i, dev in enumerate(devices if cfg.pipeline.enabled else devices[:1]):
        name = f"target-{i}" if cfg.pipeline.enabled else "trainer"
        role = Role.TARGET if cfg.pipeline.enabled else None  # one thread doing both stages has no role
        tel = stats.worker(name, role, cuda_ordinal(dev) if role is not None else None)
        targets.append(TargetStage(replicas[dev], drafter_device, tel, name, faults=faults,
                                   index=i, final=objective.needs_verifier, flops=count))
    try:
        # the saved config holds what ran
        cfg.data.batch_size, cfg.model.num_anchors = size_to_device(
            drafter, first, devices, dist, log, seq_len=cfg.data.max_seq_len, batch_size=cfg.data.batch_size,
            num_anchors=cfg.model.num_anchors, hs_queue_size=cfg.pipeline.hs_queue_size)
        drafter.num_anchors = cfg.model.num_anchors
    except RecipeError as e:
        raise TrainError(str(e)) from None
    cuda = drafter_device.type == "cuda" or any(t.device.type == "cuda" for t in targets)
    # a followed cache is written in row order: its first pass reads the rows in that order too
    source = BatchSource(samples, cfg.data.batch_size, cfg.data.seed, pad, dist.rank, dist.world_size,
                         block_size=dcfg.plan_block_size, num_anchors=cfg.model.num_anchors, pin=cuda,
                         in_order_first=first.waits_for_inputs, flops=count, bucket=cfg.data.length_buckets,
                         train=train, stats=stats)
    tell = event or (lambda kind, line, **data: log(f"[{kind}] {line}"))
    skipped: list[str] = []

    def bad_sample(line: str) -> None:  # a cache's file that did not read, skipped: counted, warned once
        skipped.append(line)
        stats.count(Counter.BAD_SAMPLES)
        tell("warning", line)

    for t in replicas.values():
        t.read_ahead(source.sample_ids)
        t.on_bad_sample(bad_sample)
    limit_epochs(cfg, source.per_epoch, log)
    return Components(first, verifier, targets, drafter, dcfg, source, stats, generator, data_path, len(samples),
                      evals, skipped, peak)


def count_flops(dcfg: Any, target: Target, objective: Objective, devices: list[torch.device],
                log: Callable[[str], None]) -> tuple[FlopCount | None, float | None]:
    """The run's per-step FLOP count (None: these shapes cannot be counted) and the peak MFU is against
    (None: no MFU), said in one line: what the log and dflash-top will show."""
    try:
        count = FlopCount.for_run(dcfg, target, objective)
    except FlopCountError as e:
        log(f"mfu:       n/a: {e}, so neither MFU nor model TFLOP/s is shown")
        return None, None
    peak, what = devices_peak(devices if target.computes else devices[:1])
    log(f"mfu:       against {what}; model FLOPs counted per step from its real tokens" if peak is not None
        else f"mfu:       n/a ({what}); model TFLOP/s still counted per step from its real tokens")
    return count, peak


def make_objective(cfg: TrainConfig, model: Any, target: Target, lm_head: Any,
                   device: torch.device) -> tuple[Objective, Any]:
    """The run's objective (dflash.objectives) and, when it compares with the verifier, the target's
    final norm and LM head on the drafter's device (None otherwise)."""
    try:
        objective = for_drafter(cfg.objective, model)
        if not objective.needs_verifier:
            return objective, None
        return objective, NormedHead(target.final_norm(device), lm_head)
    except (ValueError, TargetError) as e:
        raise TrainError(str(e)) from None


def read_samples(cfg: TrainConfig, target: Target, given: list[Sample] | None,
                 log: Callable[[str], None] = print) -> tuple[Sequence[Sample], Path]:
    """The run's samples and where they came from: `given`, else the target's own rows (a cache holds
    its token ids), else the token store of `cfg.run.data` (prepared from the JSONL file on first use,
    memory-mapped after), with what the length limit cuts said in one line."""
    from dflash.data.prepare import open_store

    if given is not None:
        return given, Path("<given samples>")
    if own := target.own_samples(cfg.data.max_seq_len, cfg.model.block_size):
        return own, Path(cfg.run.hidden_states or "<the target's own rows>")
    if target.tokenizer is None:
        raise TrainError(f"target {cfg.run.target!r} has no tokenizer: dflash needs one to read the data")
    store = open_store(cfg.run.data, target.tokenizer, max_seq_len=cfg.data.max_seq_len,
                       min_loss_tokens=cfg.model.block_size, thinking=cfg.data.thinking,
                       run_dir=Path(cfg.run.run_dir) if cfg.run.run_dir else None, log=log)
    log(f"data: {store.describe()}")
    log(store.truncation.line())
    if not len(store):
        raise TrainError(f"{store.root}: no usable rows (need at least {cfg.model.block_size} supervised tokens "
                         f"within {cfg.data.max_seq_len})")
    return store, store.root


def publish_truncation(stats: Any, samples: Sequence[Sample]) -> None:
    """The length limit's toll as gauges (dflash-top's header shows it): the limit, the samples it cuts
    and the share of supervised tokens it loses (nothing for data that is not a token store)."""
    cut = getattr(samples, "truncation", None)
    if cut is None:
        return
    stats.gauge(Gauge.MAX_SEQ_LEN, cut.limit)
    stats.gauge(Gauge.CUT_SAMPLES, cut.cut_rows)
    stats.gauge(Gauge.CUT_SUPERVISED_SHARE, cut.cut_share)


def eval_set(cfg: TrainConfig, samples: Sequence[Sample], data_path: Path, target: Target, verifier: Any,
             resuming: bool, given: bool = False) -> EvalSet:
    """What the run evaluates on: --eval-data's first prompts; the demo's own held-out prompts (unless the
    caller gave the samples: ``given``); else rows
    of the training data held out of training (chosen by a hash of row and seed, or on --resume the ones the
    run recorded). Nothing is held out when nothing will be evaluated. A run resumed from before rows were
    held out keeps training on all of them (its data order stays exact) and evaluates on the first rows of
    --data, as it did, saying that it trained on them."""
    from dflash.data import load_prompts
    from dflash.data.held_out import choose_rows, prompt_of_sample, read_record

    e = cfg.eval
    recorded = read_record(Path(cfg.run.run_dir), len(samples)) if resuming and cfg.run.run_dir else None
    kept = recorded or []  # rows held out before stay out, whatever this run evaluates on
    if e.eval_prompts <= 0 or verifier is None:
        return EvalSet([], "", kept)
    tok = target.tokenizer
    if e.eval_data is not None:
        prompts = load_prompts(e.eval_data, tok, limit=e.eval_prompts)
        return EvalSet(prompts, f"{plural(len(prompts), 'prompt')} of --eval-data {e.eval_data}", kept)
    own_rows = cfg.run.hidden_states is None
    if own_rows and cfg.run.data == "demo" and not given:
        prompts = load_prompts("demo", tok, limit=e.eval_prompts)
        return EvalSet(prompts, f"{plural(len(prompts), 'held-out demo prompt')}", kept)
    source = f"--data {cfg.run.data}" if own_rows else f"--hidden-states {cfg.run.hidden_states}"
    if resuming and not recorded:
        prompts = load_prompts(cfg.run.data, tok, limit=e.eval_prompts)
        return EvalSet(prompts, f"the first {plural(len(prompts), 'row')} of --data {cfg.run.data} (trained on: "
                       "the run began holding out no rows)", kept)
    # never more than a tenth of the rows: a small data set keeps what it has for training
    count = min(e.eval_prompts, len(samples) // HELD_OUT_SHARE)
    if recorded is None and count == 0:
        return EvalSet([], f"{source} has {plural(len(samples), 'row')}, too few to hold any out "
                       f"(at most 1 in {HELD_OUT_SHARE}); give --eval-data FILE", kept)
    rows = recorded if recorded is not None else choose_rows(samples, cfg.data.seed, count)
    if not rows:
        raise TrainError(f"{source}: no row has a prompt (tokens before its first supervised one) to hold out "
                         "for evaluation: give --eval-data FILE, or --eval-prompts 0")
    prompts = [p for r in rows[:e.eval_prompts] if (p := prompt_of_sample(samples[r])) is not None]
    return EvalSet(prompts, f"{plural(len(prompts), 'held-out row')} of {source}", rows)


def make_drafter(cfg: TrainConfig, target: Target, ckpt: dict | None,
                 log: Callable[[str], None]) -> tuple[Any, Any]:
    """The drafter (on the host) and its DrafterConfig: the checkpoint's shape and weights when resuming,
    else a fresh one shaped for `target`, started from --init-from's weights or the target's top layers
    (--init-from-target) or at random (seeded by the run's seed)."""
    from dflash.model.dflash2 import build_drafter, config_from_dict
    from dflash.model.drafter import init_from_target
    from dflash.model.export import DrafterLoadError
    from dflash.model.loading import check_shapes

    start = None  # the weights a fresh run starts from (--init-from), else random
    if ckpt is not None:
        try:
            dcfg = config_from_dict(ckpt["drafter_config"])
            check_shapes(dcfg, {k: tuple(v.shape) for k, v in ckpt["drafter"].items()}, "the checkpoint")
        except (DrafterLoadError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TrainError(f"--resume: the checkpoint's drafter does not load: {e}") from None
    else:
        try:
            dcfg, start = new_drafter_config(cfg, target)
        except (DrafterLoadError, ValueError) as e:
            raise TrainError(str(e)) from None
    torch.manual_seed(cfg.data.seed)
    random.seed(cfg.data.seed)
    model = build_drafter(dcfg)
    if ckpt is not None:
        model.load_state_dict(ckpt["drafter"])  # before DDP, which broadcasts rank 0's weights
    elif start is not None:
        model.load_state_dict(start)
        log(f"drafter initialised from {cfg.model.init_from} ({dcfg.describe_layers()})")
    if cfg.model.init_from_target and ckpt is None:
        if target.verifier is None:
            raise TrainError("--init-from-target needs the target's layers, which this target does not load: "
                             "drop the flag")
        copied = init_from_target(model, target.verifier.model)
        log(f"drafter initialised from the target's top {plural(dcfg.num_layers, 'layer')} ({len(copied)} tensors)")
    return model, dcfg


def evaluator(cfg: TrainConfig, target: Target, device: torch.device, log: Callable[[str], None]) -> Any:
    """What evaluates the drafter: --eval-target when given (loaded on the first target worker's
    `device`), else the target if it can decode. A target that only supplies hidden states (a cache)
    cannot: in-training evaluation is refused before anything runs, and the final one is skipped with a
    line saying so."""
    from dflash.targets import load_target

    if cfg.eval.eval_target is None:
        if target.verifier is None and cfg.eval.eval_prompts > 0:
            source = (f"--hidden-states {cfg.run.hidden_states}" if cfg.run.hidden_states
                      else f"target {cfg.run.target!r}")
            fix = f"--eval-target MODEL_DIR (e.g. --eval-target {cfg.run.target})"
            if cfg.eval.eval_every > 0:
                raise TrainError(f"--eval-every: {source} supplies hidden states only and cannot decode; give {fix} "
                                 "or drop --eval-every")
            log(f"no final evaluation: {source} cannot decode (give {fix})")
        return target.verifier
    verifier = load_target(cfg.eval.eval_target, device=device, layer_ids=target.layer_ids)
    mine, theirs = (target.num_layers, target.hidden_size, target.vocab_size), \
        (verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    if mine != theirs:
        raise TrainError(f"--eval-target {cfg.eval.eval_target!r} is not the target: (layers, hidden, vocab) "
                         f"{theirs} against the target's {mine}")
    return verifier


def new_drafter_config(cfg: TrainConfig, target: Any) -> tuple[Any, dict | None]:
    """A fresh run's DrafterConfig, and the weights to start from (None: random): the release's with
    --init-from (checked against the target), else shaped like the target; the layer settings apply to both."""
    from dflash.model.dflash2 import DFlash2Config
    from dflash.model.drafter import DrafterConfig
    from dflash.model.released import start_from_release
    from dflash.targets.heads import applied

    m = cfg.model
    if m.init_from:
        return start_from_release(m.init_from, target, block_size=m.block_size, gamma=m.gamma,
                                  num_layers=m.drafter_layers, layer_types=m.drafter_layer_types,
                                  sliding_window=m.drafter_sliding_window, drafter_type=m.drafter_type)
    dcfg = DrafterConfig.for_target(
        target.config, num_layers=m.drafter_layers or len(m.drafter_layer_types or target.layer_ids),
        block_size=m.block_size,
        target_layer_ids=target.layer_ids, mask_token_id=target.default_mask_token_id(), gamma=m.gamma,
    )
    dcfg = replace(dcfg, layer_types=m.drafter_layer_types, sliding_window=m.drafter_sliding_window)
    if m.drafter_type == "dspark":
        from dflash.model.dspark import DSparkConfig

        gamma = dcfg.gamma if m.gamma is not None else None  # None: DSpark's own decay (4), not DFlash's
        dcfg = DSparkConfig(**{**dcfg.__dict__, "gamma": gamma}, markov_rank=m.markov_rank)
    if m.drafter_type == "dflash2":
        scale, cap = applied(*target.frozen_head(target.device))
        dcfg = DFlash2Config(**dcfg.__dict__, conv_kernel_size=m.conv_kernel_size, conv_group_size=m.conv_group_size,
                             selector_rank=m.selector_rank, selector_top_k=m.selector_top_k,
                             input_embedding_scale=scale, final_logit_softcapping=cap)
    return dcfg, None


def limit_epochs(cfg: TrainConfig, per_epoch: int, log: Callable[[str], None]) -> None:
    """--epochs becomes a step budget once the batches per epoch are known (the same on every rank),
    so the LR schedule, the stop and the progress line all count steps; the saved config shows it."""
    if cfg.run.epochs is None:
        return
    steps = max(1, math.ceil(cfg.run.epochs * per_epoch))
    cfg.run.max_steps = min(cfg.run.max_steps, steps) if cfg.run.max_steps else steps
    log(f"epochs:    {cfg.run.epochs:g} x {plural(per_epoch, 'step')} per pass over the data"
        f" -> at most {plural(cfg.run.max_steps, 'step')}")


def restore(ckpt: dict, parts: Components, dist: Dist, log: Callable[[str], None]) -> TrainCounters:
    """Put a checkpoint's optimizer, anchor RNG and data position back and return where the run stood (the
    drafter's weights and shape are `build`'s: they decide what is built)."""
    parts.drafter.optimizer.load_state_dict(ckpt["optimizer"])
    per_rank = ckpt.get("rng_per_rank")
    s = ckpt["state"]
    if per_rank is not None and len(per_rank) == dist.world_size:
        notes = rng.restore(per_rank[dist.rank], parts.generator)
    else:
        if per_rank is not None or dist.enabled:
            log(f"resuming a {len(per_rank or [0])}-rank run on {dist.world_size} rank(s): every rank "
                "continues rank 0's anchor sampling; the data continues at the sample it stopped at, "
                f"{dist.world_size} ways")
        notes = rng.restore(ckpt["rng"], parts.generator)
    for line in notes:
        log(f"--resume: {line}")
    at = data_position(ckpt, parts.source)
    try:
        parts.source.resume_at(s["next_batch"], at)
    except ValueError as e:
        raise TrainError(f"--resume: {e}") from None
    state = TrainCounters(step=s["step"], next_batch=s["next_batch"], tokens=s["tokens"], samples=s["samples"],
                          train_time=s["train_time"])
    log(f"resumed from step {state.step} (batch {state.next_batch}: epoch {at.epoch}, sample {at.consumed:,} of "
        f"{at.samples:,}; {state.train_time:.0f}s trained)")
    return state


def data_position(ckpt: dict, source: BatchSource) -> DataPosition:
    """Where a checkpoint's run stood in its data. Checkpoints before the position was recorded hold only
    the next batch index: their steps took batch size x world size samples of a plain shuffle each, the
    world size being the count of ranks whose RNG they hold and the batch size their saved config's."""
    s = ckpt["state"]
    if "data" in s:
        try:
            return DataPosition.from_dict(s["data"])
        except ValueError as e:
            raise TrainError(f"--resume: {e}") from None
    ranks = len(ckpt.get("rng_per_rank") or [0])
    try:
        batch_size = read_saved(ckpt["config"], "the checkpoint's config").data.batch_size
    except (KeyError, ConfigError):
        batch_size = source.batch_size
    n = len(source.train)
    step = min(batch_size * ranks, n)
    epoch, k = divmod(s["next_batch"], max(1, n // step))
    return DataPosition(epoch, k * step, step, False, n)
