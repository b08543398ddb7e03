"""Training configuration: every setting of a run, declared once, in the section class it belongs to.

A setting is a field of a section (``cfg.optim.lr``, ``cfg.pipeline.target_devices``) with its type,
default and help line; `dflash/train/config/schema.py` derives the rest from these classes: the flag
(``--lr``), the TOML keys (``[optim] lr = 3e-3`` or a flat ``lr = 3e-3``), the type check and the
merge of defaults, hardware recipe, file and flags. A setting's flat name (its field name, unless it
says otherwise) is unique across sections: it is the flag, the top-level TOML key and the key of
``config.json`` files saved before the sections existed. The section's docstring heads its flags in
``dflash train --help``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad setting; the message names it."""


def setting(default: Any = None, help: str | None = None, *, factory: Callable[[], Any] | None = None,
            choices: dict[str, Any] | list[str] | None = None, metavar: str | None = None,
            flat: str | None = None) -> Any:
    """A section field with what its flag is derived from: the help line (None: no flag, set it in a
    TOML file), the words it takes (a dict maps each word to the value it sets, as
    ``--pipeline on|off``) and, where the field's own name would be ambiguous outside its section
    (``enabled``), the flat name that stands for it in flags and top-level keys."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "flat": flat}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunSettings:
    """what to train and when to stop"""

    target: str = setting("tiny", "HF model directory or 'tiny' (the built-in target)")
    data: str = setting("demo", "JSONL dataset (tokenized once into a token store beside it), a store directory "
                        "from `dflash data prepare`, or 'demo'")
    hidden_states: str | None = setting(None, "train from an offline hidden-states cache (the vLLM/speculators "
                                        "layout, `dflash data cache`) instead of running --target, which then "
                                        "supplies only the tokenizer, embedding and LM head; --data is unused",
                                        metavar="DIR")
    follow: bool = setting(False, "with --hidden-states: wait for files still being written (an engine or "
                           "`dflash data cache` filling the directory)")
    run_dir: str | None = setting(None, "where checkpoints, config.json and telemetry.jsonl go (default: a "
                                  "fresh runs/train-<date>-<time>, so two runs never collide)")
    run_name: str | None = setting(None, "the run's name in telemetry (default: the run directory's name)")
    max_steps: int | None = setting(None, "stop after this many optimizer steps")
    max_time: float | None = setting(None, "stop after this many seconds of training")
    epochs: float | None = setting(None, "passes over the data, fractions allowed (default 1 when no step or "
                                   "time limit is given)")
    log_every: float = setting(10.0, "seconds between log lines, one line each (default 10)")
    log_table_every: float = setting(300.0, "seconds between the category tables (with the verdict and its "
                                     "evidence) in the log; the end of the run always has one (default 300)")
    log_table: bool = setting(False, "the category table, the verdict and its evidence after every log line")


@dataclass
class ModelSettings:
    """the drafter's shape"""

    # None: derived from the target, as the reference does
    drafter_layers: int | None = setting(None, "drafter layers (default: one per target tap)")
    block_size: int = setting(16, "tokens per block: an anchor and the ones drafted after it (default 16)")
    num_anchors: int = setting(512, "anchors (blocks) sampled per sequence (default 512)")
    gamma: float | None = setting(None, "--position-weight exp's decay over block positions (default: the "
                                  "recipe's)")
    target_layer_ids: list[int] | None = setting(None, "comma-separated target layers whose hidden states the "
                                                 "drafter reads (default: spread evenly)", metavar="IDS")
    # not in the reference recipe, which starts from random weights; it speeds up short runs a lot
    init_from_target: bool = setting(False, "start the drafter's layers as copies of the target's top layers")
    drafter_layer_types: list[str] | None = setting(None, "comma-separated, one per drafter layer: full_attention "
                                                    "or sliding_attention (default: all full, or --init-from's)",
                                                    metavar="TYPES")
    drafter_sliding_window: int | None = setting(None, "positions a sliding_attention layer sees, its own included "
                                                 "(the reference's Qwen3.6 drafters: 2048)", metavar="W")
    init_from: str | None = setting(None, "start from a released drafter in the reference format (config.json + "
                                    "model.safetensors, e.g. from `dflash export`), checked against the target",
                                    metavar="DIR")
    # DFlash2 (docs/dflash2.md): the published drafters' settings are the defaults
    drafter_type: str = setting("dflash", "dflash; dflash2: a convolution around each sublayer and a candidate "
                                "selector; dspark: a Markov head and a confidence head, drafting from the anchor "
                                "slot, block 7 (default dflash; --init-from's release says its own)",
                                choices=["dflash", "dflash2", "dspark"])
    conv_kernel_size: int = setting(2, "dflash2: taps of the convolution over a block's tokens (default 2)")
    conv_group_size: int = setting(16, "dflash2: channels sharing one predicted kernel coefficient; divides the "
                                   "hidden size (default 16)")
    selector_rank: int = setting(256, "dflash2: rank of the selector's codebooks (default 256)")
    selector_top_k: int = setting(16, "dflash2: candidates per slot the selector re-ranks (default 16)")
    markov_rank: int = setting(256, "dspark: rank of the Markov head's bigram bias on the logits (default 256)")


    def check_layers(self) -> None:
        """Layer types against the layer count and the window (what --init-from leaves open stays open)."""
        if self.init_from is not None and self.init_from_target:
            raise ConfigError("--init-from and --init-from-target both set the drafter's weights: keep one")
        kinds = ("full_attention", "sliding_attention")  # dflash.model.drafter.LAYER_TYPES, without torch
        types, window = self.drafter_layer_types, self.drafter_sliding_window
        if window is not None and window < 1:
            raise ConfigError(f"drafter_sliding_window must be at least 1, got {window}")
        if types is None:
            if window is not None and self.init_from is None:
                raise ConfigError("--drafter-sliding-window needs sliding layers: add --drafter-layer-types, e.g. "
                                  "sliding_attention,full_attention")
            return
        bad = [t for t in types if t not in kinds]
        if bad:
            raise ConfigError(f"drafter_layer_types: {bad[0]!r} is not a layer type; use {' or '.join(kinds)}")
        # with --init-from the release settles the count (config/released.py checks it against the types)
        if self.drafter_layers is not None and self.init_from is None and len(types) != self.drafter_layers:
            raise ConfigError(f"drafter_layer_types names {len(types)} layer(s) for {self.drafter_layers} drafter "
                              "layers: give one type per layer")
        if "sliding_attention" in types and window is None and self.init_from is None:
            raise ConfigError("sliding_attention layers need a window: add --drafter-sliding-window W")

    def check_dspark(self, loss: str) -> None:
        """DSpark's settings: its rank, and the token term its objective is written for."""
        if self.drafter_type != "dspark":
            return
        from dflash.model.dspark import settings_problem

        problem = settings_problem(self.markov_rank)
        if problem:
            raise ConfigError(problem)
        if loss != "ce":
            raise ConfigError(f"a DSpark drafter trains 0.1 x cross-entropy + 0.9 x total variation + its confidence "
                              f"loss: use --loss ce, not {loss}")

    def check_dflash2(self) -> None:
        """DFlash2's settings, as far as they can be judged before the target loads (its hidden size and
        vocabulary are checked when the drafter is built)."""
        if self.drafter_type != "dflash2":
            return
        from dflash.model.dflash2 import settings_problem

        problem = settings_problem(self.conv_kernel_size, self.conv_group_size, self.selector_rank,
                                   self.selector_top_k, block_size=self.block_size)
        if problem:
            raise ConfigError(problem)


@dataclass
class ObjectiveSettings:
    """the objective (dflash/objectives/: what the drafter learns to match, how block positions weigh)"""

    loss: str = setting("ce", "ce: cross-entropy to the data's next tokens; kl: KL to the verifier's (target's) "
                        "distribution at each slot (default ce)", metavar="ce|kl")
    # D-PACE is the default where it can be (the recipe table in docs/objectives.md: it accepts most)
    position_weight: str | None = setting(None, "exp: slot k weighs exp(-(k-1)/gamma); dpace: by its share of "
                                          "the expected accepted length, from the drafter's confidence (needs "
                                          "--loss ce; default dpace with ce, exp with kl)", metavar="exp|dpace")
    dpace_alpha: float = setting(0.5, "D-PACE's confidence smoothing, in (0, 1] (default 0.5)")
    # a DFlash2 drafter's selector term (dflash/objectives/selector.py)
    selector_loss_weight: float = setting(1.0, "dflash2: weight of the selector's loss once ramped in (default 1)")
    selector_warmup: float = setting(0.0, "dflash2: fraction of the run before the selector's loss starts "
                                     "(default 0)")
    selector_ramp: float = setting(0.05, "dflash2: fraction of the run over which the selector's loss weight "
                                   "rises linearly to --selector-loss-weight (default 0.05)")

    def check_selector(self) -> None:
        if self.selector_loss_weight < 0:
            raise ConfigError(f"selector_loss_weight must be 0 or more, got {self.selector_loss_weight}")
        for name in ("selector_warmup", "selector_ramp"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} is a fraction of the run, in [0, 1]; got {getattr(self, name)}")


@dataclass
class DataSettings:
    """batches"""

    max_seq_len: int = setting(512, "longest sample in tokens: longer ones are cut, and the run says how many and "
                               "what share of supervised tokens that loses (the GPU recipe: 3072)")
    thinking: str = setting("auto", "how 'messages' rows render reasoning: on, off, or auto (as each row has it); "
                            "part of the token store's stamp, so a store made another way is refused",
                            choices=["on", "off", "auto"])
    batch_size: int = setting(8, "samples per step (per rank)")
    seed: int = setting(0, "seed of the data order, the anchors, the held-out rows and the drafter's init")
    length_buckets: bool = setting(True, "on: each step's rows have similar lengths (shuffled, sorted by length "
                                   "in windows of 64 steps, the steps shuffled), so a batch pads little; off: "
                                   "a plain shuffle (default on)", choices={"on": True, "off": False})


@dataclass
class OptimSettings:
    """optimisation (the recipe: AdamW 6e-4, cosine, 4% warmup, clip 1.0)"""

    # AdamW stays the default until Muon's state is in the checkpoint's reserved buffers (docs/objectives.md)
    optimizer: str = setting("adamw", "adamw, or muon: Muon for the drafter's weight matrices and AdamW for the "
                             "rest (norms, biases, vocabulary tables; default adamw)", metavar="adamw|muon")
    lr: float = setting(6e-4, "peak learning rate (default 6e-4)")
    muon_lr: float | None = setting(None, "with --optimizer muon: the Muon matrices' peak learning rate, on the "
                                    "same schedule; AdamW's vocabulary tables (codebooks, Markov head) take it too "
                                    "(default --lr: the update is RMS-matched to AdamW's)")
    min_lr_ratio: float = setting(0.0, "the cosine schedule's floor, as a fraction of lr")
    warmup_ratio: float = setting(0.04, "fraction of the run spent warming up (default 0.04)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    grad_clip: float = setting(1.0, "gradient norm clip (default 1.0)")


@dataclass
class PipelineSettings:
    """devices, workers and queues"""

    # one target worker per entry
    target_devices: list[str] = setting(help="comma-separated, one target worker each: cpu, cuda:0,cuda:1, ...",
                                        factory=lambda: ["cpu"])
    drafter_device: str = setting("cpu", "cpu or cuda:N")
    enabled: bool = setting(True, "off: target forward then drafter step in one loop, as public trainers do",
                            choices={"on": True, "off": False}, flat="pipeline")
    batch_queue_size: int = setting(4, "batches the producer may build ahead (default 4)")
    hs_queue_size: int = setting(2, "hidden-state batches the targets may hand ahead (default 2)")
    threads_per_worker: int | None = setting(None, "torch intra-op threads per worker thread (default: leave "
                                             "torch's)")


@dataclass
class CheckpointSettings:
    """checkpoints"""

    checkpoint_every: float | None = setting(None, "seconds between checkpoints (default: one minute per GB of "
                                             "checkpoint, at least 60)")
    keep_checkpoints: int = setting(3, "newest checkpoints kept (default 3; older ones go first when disk is "
                                    "short)")


@dataclass
class EvalSettings:
    """in-training and final evaluation (real speculative decoding)"""

    eval_every: float = setting(0.0, "seconds between in-training evaluations (0: only at the end)")
    eval_prompts: int = setting(8, "prompts in each evaluation (0: none); without --eval-data that many rows of "
                                "--data are held out of training for it (chosen by a hash of row and seed)")
    eval_data: str | None = setting(None, "a JSONL of prompts to evaluate on (rows as --data's; the first "
                                    "--eval-prompts of them) instead of rows held out of --data", metavar="FILE")
    eval_max_new_tokens: int = setting(64, "tokens generated per evaluation prompt (default 64)")
    eval_target: str | None = setting(None, "HF model directory or 'tiny' that evaluates the drafter (default: "
                                      "the target itself; needed when the target only supplies hidden states)")


@dataclass
class TelemetrySettings:
    """telemetry, Prometheus and experiment trackers"""

    enabled: bool = setting(True, "live telemetry: socket, telemetry.jsonl, watchdog (the flag turns it off "
                            "entirely)", flat="telemetry")
    telemetry_interval: float = setting(1.0, "seconds between telemetry snapshots (default 1)")
    socket_dir: str | None = setting(None, "directory for the telemetry socket")
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port (0: any free port)")
    metrics_addr: str = setting("127.0.0.1", "address for --metrics-port (default 127.0.0.1; 0.0.0.0 for remote "
                                "Prometheus)")
    metrics_linger: float = setting(30.0, "with --metrics-port: seconds to keep serving after the run, until "
                                    "Prometheus has scraped its last numbers (default 30; 0: exit at once)")
    report_to: list[str] = setting(help="experiment trackers fed every log interval and evaluation (rank 0), "
                                   "comma-separated: tensorboard, wandb, mlflow (default none; each an optional "
                                   "extra)", factory=list, metavar="TRACKERS")
    gil_probe: bool = setting(True, "the GIL contention gauge (the flag turns it off: its probe thread takes the "
                              "GIL 200 times a second)")


@dataclass
class HealthSettings:
    """stall watchdog, non-finite steps (docs/telemetry.md) and bad samples in a cache (docs/cache.md)"""

    stall_timeout: float | None = setting(None, "seconds without a completed span before a worker counts as "
                                          "stalled (default: from its own history, at least 30; 0: no watchdog)")
    on_stall: str = setting("warn", "exit: checkpoint the last completed step and exit 3 so a scheduler can "
                            "restart the job (default warn)", choices=["warn", "exit"])
    nonfinite_limit: int = setting(3, "non-finite steps in a row (each skipped) that stop the run (default 3)")
    max_bad_samples: int = setting(100, "with --hidden-states: sample files that do not read (truncated, garbled, "
                                   "wrong shape, other tokens, NaN/inf) skipped, each with a warning, before the "
                                   "run stops (default 100; 0: stop at the first)", metavar="N")


@dataclass
class DistributedSettings:
    """multi-rank runs (torchrun)"""

    collective_timeout: float = setting(300.0, "multi-rank: seconds a collective may wait for a rank before the "
                                        "job gives up on it (default 300)")
    bucket_mb: float = setting(25.0, "multi-rank: size in MB of DDP's gradient buckets, each all-reduced as soon as "
                               "it fills during backward (default 25, DDP's own)")


@dataclass
class TrainConfig:
    """Every setting of a run, by section. ``to_dict()`` (config.json, a checkpoint's "config") nests the
    same way; `dflash.train.config.schema.read_saved` reads it back, and the flat form of earlier releases."""

    run: RunSettings = field(default_factory=RunSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)

    def __post_init__(self) -> None:
        # flat name -> where its value came from (the command line, a file's path, the hardware recipe,
        # a saved config.json; schema.stated says it); a setting left at its default has none. Not a
        # field: config.json holds what ran, not how it was asked for.
        self.origins: dict[str, str] = {}

    def origin(self, name: str) -> str | None:
        """Where setting `name` (flat) was set, None for its default."""
        return self.origins.get(name)

    @property
    def name(self) -> str:
        return self.run.run_name or Path(self.run.run_dir or "").name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def validate(self) -> None:
        """What a type cannot say: ranges, and settings that only make sense together."""
        run, pipe, tel, health = self.run, self.pipeline, self.telemetry, self.health
        if not pipe.target_devices:
            raise ConfigError("target_devices is empty: give at least one device, e.g. cpu or cuda:0")
        if pipe.drafter_device.startswith("cpu") and any(d.startswith("cuda") for d in pipe.target_devices):
            raise ConfigError("a CUDA target needs a CUDA drafter (--drafter-device cuda): a CPU drafter would "
                              "wait on the host for every hidden-state copy")
        for dev in [*pipe.target_devices, pipe.drafter_device]:
            check_device(dev)
        if run.max_steps is None and run.max_time is None and run.epochs is None:
            raise ConfigError("give max_steps, max_time or epochs so the run and its LR schedule have an end")
        if run.epochs is not None and run.epochs <= 0:
            raise ConfigError(f"epochs must be positive, got {run.epochs}")
        if run.follow and run.hidden_states is None:
            raise ConfigError("--follow needs --hidden-states DIR: the cache directory to follow")
        positive = {"block_size": self.model.block_size, "num_anchors": self.model.num_anchors,
                    "batch_size": self.data.batch_size, "max_seq_len": self.data.max_seq_len, "lr": self.optim.lr,
                    "log_every": run.log_every, "log_table_every": run.log_table_every,
                    "telemetry_interval": tel.telemetry_interval,
                    "batch_queue_size": pipe.batch_queue_size, "hs_queue_size": pipe.hs_queue_size,
                    "keep_checkpoints": self.checkpoint.keep_checkpoints,
                    "collective_timeout": self.distributed.collective_timeout,
                    "bucket_mb": self.distributed.bucket_mb}
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.model.block_size < 2:
            raise ConfigError("block_size must be at least 2 (an anchor and one predicted token)")
        if tel.metrics_port is not None and not tel.enabled:
            raise ConfigError("--metrics-port needs telemetry; drop --no-telemetry")
        if tel.metrics_port is not None and not 0 <= tel.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0-65535, got {tel.metrics_port}")
        from dflash.train.reporting.trackers import KNOWN

        unknown = [t for t in tel.report_to if t not in KNOWN]
        if unknown:
            raise ConfigError(f"report_to: unknown tracker {unknown[0]!r}; choose from {', '.join(KNOWN)} (or none)")
        if health.stall_timeout is not None and health.stall_timeout < 0:
            raise ConfigError(f"stall_timeout must be seconds >= 0 (0: no watchdog), got {health.stall_timeout!r}")
        if health.on_stall not in ("warn", "exit"):
            raise ConfigError(f"on_stall must be 'warn' or 'exit', got {health.on_stall!r}")
        if health.on_stall == "exit" and (not tel.enabled or health.stall_timeout == 0):
            raise ConfigError("--on-stall exit needs the stall watchdog: drop --no-telemetry / --stall-timeout 0")
        if health.nonfinite_limit < 1:
            raise ConfigError(f"nonfinite_limit must be at least 1, got {health.nonfinite_limit}")
        if health.max_bad_samples < 0:
            raise ConfigError(f"max_bad_samples must be >= 0 (0: stop at the first bad sample), got "
                              f"{health.max_bad_samples}")
        self.check_objective()
        if not 0 <= self.optim.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.optim.warmup_ratio}")
        self.model.check_layers()
        self.model.check_dflash2()
        self.model.check_dspark(self.objective.loss)
        self.objective.check_selector()


    def check_objective(self) -> None:
        """Names the objective and optimizer registries know, and their ranges."""
        from dflash.objectives import check, weighting_for
        from dflash.objectives.optim import OPTIMIZERS, MuonUnavailable, guarded_muon

        # the default follows the loss; resolved here so that the run's saved config names it
        self.objective.position_weight = weighting_for(self.objective.loss, self.objective.position_weight)
        try:
            check(self.objective.loss, self.objective.position_weight)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 0 < self.objective.dpace_alpha <= 1:
            raise ConfigError(f"dpace_alpha must be in (0, 1], got {self.objective.dpace_alpha}")
        if self.optim.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer: unknown optimizer {self.optim.optimizer!r}; choose from "
                              f"{', '.join(OPTIMIZERS)}")
        if self.optim.muon_lr is not None and self.optim.muon_lr <= 0:
            raise ConfigError(f"muon_lr must be positive, got {self.optim.muon_lr}")
        if self.optim.optimizer == "muon":
            try:  # torch's Muon is private: asked for here, before the run starts, and only for Muon
                guarded_muon()
            except MuonUnavailable as e:
                raise ConfigError(str(e)) from None


def check_device(dev: str) -> None:
    """Fail at once, in one line, on a device this machine does not have."""
    import torch

    try:
        d = torch.device(dev)
    except RuntimeError:
        raise ConfigError(f"unknown device {dev!r}: use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise ConfigError(f"unsupported device {dev!r}: dflash trains on cpu or cuda devices")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {dev!r} requested but CUDA is not available on this machine")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"device {dev!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
