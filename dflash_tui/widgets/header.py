"""The two header lines: who we are watching (run, host, pid, rank, uptime, connection; the bad samples a
cache reader skipped and the samples the length limit cuts, when there are any) and how it goes (step,
tokens/s, MFU and model TFLOP/s, loss with the objective's terms, simulated tau, labelled `sim tau`: the
real one comes from evaluations). The connection state comes first so it survives an 80-column crop.
"""

from __future__ import annotations

from rich.text import Text

from dflash.telemetry.wire.protocol import Sampling
from dflash.telemetry.wire.table import tflops as tflops_text
from dflash.telemetry.wire.vocab import Gauge
from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped
from dflash_tui.widgets.palette import STATE_STYLE


class RunHeader(TextPanel):
    DEFAULT_CSS = """
    RunHeader { height: 2; background: $panel; color: $text; padding: 0 1; }
    """

    def build(self, state: RunState, width: int) -> Text:
        return header_text(state, width)


def header_text(state: RunState, width: int = 200) -> Text:
    h = state.hello
    t = cropped()
    t.append(f"● {state.connection.upper()}", style=STATE_STYLE.get(state.connection, "bold"))
    if h is not None:
        t.append("  run ", style="dim").append(h.run, style="bold")
        t.append("  pid ", style="dim").append(f"{h.pid}@{h.host}")
        t.append("  rank ", style="dim").append(f"{h.rank}/{h.world_size}")
    else:
        t.append("  waiting for the trainer's hello", style="dim")
    t.append("  up ", style="dim").append(fmt.clock(state.uptime_s))
    if bad := state.bad_samples:  # a cache's unreadable files, skipped: the log names each one
        t.append(f"  {bad:,} bad sample{'s' if bad != 1 else ''} skipped", style="bold yellow")
    t.append_text(cut_text(state))
    t.append("\n")
    sampling = state.snapshot.sampling if state.snapshot is not None else None
    if sampling is not None:  # a process watched from outside: no steps, tokens or loss to show
        return t.append_text(sampling_text(sampling, width))
    # the sparkline is the first part that can go: a narrow terminal keeps every number whole instead
    # (`trained 0:57/5:00`, not `trained 0:57/5:0`); then the model TFLOP/s beside the MFU, then the
    # objective's terms beside the loss, the total staying, and last the training clock whole (the ETA
    # stays): never a number cut at the edge
    spark = 12 if width >= 100 else 6
    for spark_w, tflops, terms, clock in ((spark, True, True, True), (0, True, True, True), (0, False, True, True),
                                          (0, False, False, True), (0, False, False, False)):
        line = progress_line(state, spark_w, terms, tflops, clock)
        if line.cell_len <= width - 2:  # the header's padding
            break
    t.append_text(line)
    if h is None and state.connection_detail:
        t.append("  " + state.connection_detail, style="dim")
    return t


def cut_text(state: RunState) -> Text:
    """`  len 512 cuts 340 samples (22.1% sup)`: what the run's length limit cuts from its data, from the
    trainer's gauges (nothing when it cuts nothing, or says nothing)."""
    t = Text()
    cut, share, limit = (state.gauge(g) for g in (Gauge.CUT_SAMPLES, Gauge.CUT_SUPERVISED_SHARE, Gauge.MAX_SEQ_LEN))
    if not cut or limit is None:
        return t
    t.append(f"  len {limit:,.0f} cuts {cut:,.0f} sample{'s' if cut != 1 else ''}", style="yellow")
    if share is not None:
        t.append(f" ({share:.1%} sup)", style="yellow")
    return t


def sampling_text(sm: Sampling, width: int = 200) -> Text:
    """`SAMPLED py-spy --nonblocking 100 Hz  200 samples/thread ±6.9%  py-spy 4% of a core, never pauses it`:
    the figures are samples, how many, how sure, and what taking them costs the process."""
    t = Text()
    t.append(" SAMPLED ", style="bold white on magenta").append(f" {sm.tool} {sm.rate_hz:g} Hz", style="bold")
    t.append(f"  {sm.samples:,} samples/thread ±{sm.margin:.1%}", style="bold")
    if sm.total_samples > sm.samples and width >= 140:  # the whole sampling's count: where there is room
        t.append(f" ({sm.total_samples:,} ±{sm.total_margin:.1%})", style="dim")
    if sm.sampler_cpu_percent is not None:
        t.append(f"  py-spy {sm.sampler_cpu_percent:.0f}% of a core", style="dim")
    t.append(", pauses the process at each sample" if sm.native else ", never pauses it (--native would)",
             style="bold yellow" if sm.native else "dim")
    return t


def progress_line(state: RunState, spark_w: int, terms: bool = True, tflops: bool = True,
                  clock: bool = True) -> Text:
    """`step 320/1,000 32% ETA 1:25  tok/s 30.1K ▁▂▃  MFU 41.2% 407 TFLOP/s  loss 3.99  sim tau 2.97
    trained 0:40/5:00`: the tau here is the simulated one (teacher-forced on training batches), so it says
    so. ``terms``: the objective's terms after the loss (terms_text); ``tflops``: the model TFLOP/s after
    the MFU (mfu_text); ``clock``: the training clock at the end."""
    t = Text()
    step = state.step
    t.append("step ", style="dim").append(f"{step:,}" if step is not None else fmt.NA, style="bold")
    max_steps = state.gauge("max_steps")
    if max_steps is not None:
        t.append(f"/{max_steps:,.0f}", style="bold")
    head, tail = progress_text(state)
    t.append_text(head)
    t.append("  tok/s ", style="dim").append(fmt.count(state.tokens_rate), style="bold")
    spark = fmt.sparkline(state.tokens_per_s.values, spark_w, lo=0) if spark_w else ""
    if spark:
        t.append(" " + spark, style="green")
    t.append_text(mfu_text(state.gauge(Gauge.MFU), state.gauge(Gauge.TFLOPS), tflops))
    bad_loss = state.nonfinite("gauges.loss")
    t.append("  loss ", style="dim")
    t.append(bad_loss.upper(), style="bold white on red") if bad_loss else t.append(
        fmt.number(state.loss_value), style="bold")
    if terms:
        t.append_text(terms_text(state.loss_terms))
    t.append("  sim tau ", style="dim").append(fmt.number(state.tau_value), style="bold")
    if clock:
        t.append_text(tail)
    return t


def mfu_text(mfu: float | None, rate: float | None, tflops: bool = True) -> Text:
    """`  MFU 41.2% 407 TFLOP/s` from the trainer's `mfu` and `tflops` gauges (its model FLOPs per step
    against the devices' dense bf16 peak); `  MFU n/a 0.0213 TFLOP/s` where it knows no peak (the host, an
    unknown GPU): the FLOPs are counted, the utilisation would be a guess; nothing from a trainer that
    counts no FLOPs."""
    t = Text()
    if mfu is None and rate is None:
        return t
    t.append("  MFU ", style="dim")
    t.append(fmt.percent(mfu), style="bold") if mfu is not None else t.append("n/a", style="dim")
    if tflops and rate is not None:
        t.append(f" {tflops_text(rate)} TFLOP/s", style="dim")
    return t


def terms_text(terms: dict[str, float]) -> Text:
    """` (kl)`, ` (ce 2.10 + selector 0.42)`: which objective the loss is and, when it has several
    terms, each one before its weight (nothing from a trainer that publishes no terms)."""
    t = Text()
    if len(terms) == 1:
        return t.append(f" ({next(iter(terms))})", style="dim")
    if not terms:
        return t
    t.append(" (", style="dim")
    for i, (name, value) in enumerate(terms.items()):
        if i:
            t.append(" + ", style="dim")
        t.append(f"{name} ", style="dim").append(fmt.number(value))
    t.append(")", style="dim")
    return t


def progress_text(state: RunState) -> tuple[Text, Text]:
    """From the trainer's progress gauges (the numbers its log line prints): ` 42% ETA 1:20` to follow
    the step, and `  trained 2:31/5:00` for the end of the line, where a narrow terminal crops it;
    while an evaluation runs, its own progress instead."""
    head, tail = Text(), Text()
    ev = state.evaluating
    if ev is not None:
        head.append(f"  EVALUATING {ev[0]}/{ev[1]} prompts", style="bold cyan")
        eta = state.gauge("eval_eta_s")
        if eta is not None:
            head.append(f" ETA {fmt.clock(eta, short=True)}", style="cyan")
        return head, tail
    frac, eta = state.gauge("progress"), state.gauge("eta_s")
    if frac is not None:
        head.append(f" {frac:.0%}", style="bold")
    if eta is not None:
        head.append(" ETA ", style="dim").append(fmt.clock(eta, short=True), style="bold")
    elapsed, limit = state.gauge("train_time_s"), state.gauge("max_time_s")
    if elapsed is not None:
        tail.append("  trained ", style="dim").append(
            fmt.clock(elapsed, short=True) + (f"/{fmt.clock(limit, short=True)}" if limit is not None else ""))
    return head, tail
