"""GPUs from the trainer's NVML sample: utilisation and memory (with history), power, temperature, SM
clock, and how much of the memory is the trainer's own.

A machine without an NVIDIA driver is a normal state for this tool (CPU runs, laptops), so it is
shown as a calm explanation from `system.gpu_error`, not as an error.
"""

from __future__ import annotations

from rich.text import Text

from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped, waiting_for_system

SPARK_W = 16


class GpuPanel(TextPanel):
    WRAP = True  # the no-driver explanation is a sentence: wrap it rather than crop it at 80 columns

    def build(self, state: RunState, width: int) -> Text:
        return gpu_text(state, width)


def gpu_text(state: RunState, width: int) -> Text:
    sys_ = state.system
    if sys_ is None:
        return waiting_for_system()
    if not sys_.gpus:
        t = Text()  # wraps (see WRAP)
        reason = sys_.gpu_error or "the trainer reported no GPUs"
        label = "no NVIDIA driver" if "driver" in reason.lower() or "nvml" in reason.lower() else "no GPUs"
        if reason.lower().startswith(label.lower()):  # the sampler's reason already says it
            label, reason = reason[:len(label)], reason[len(label):].lstrip(" :")
        t.append(label, style="bold yellow")
        t.append(f": {reason}\n" if reason else "\n", style="yellow")
        t.append("timings, threads and py-spy still work; this panel fills in on a CUDA machine", style="dim")
        return t
    t = cropped()
    spark_w = SPARK_W if width >= 70 else 8
    for i, g in enumerate(sys_.gpus):
        if i:
            t.append("\n")
        t.append(f"GPU{g.index} ", style="bold")
        if g.cuda_index is not None:  # NVML's index need not be the trainer's cuda:N
            t.append(f"cuda:{g.cuda_index} ", style="dim")
        t.append(f"{g.name[:22]:<22} ")
        util = g.util_percent
        style = "green" if util is not None and util >= 70 else "yellow" if util is not None and util >= 30 else "red"
        t.append("util ", style="dim").append(f"{fmt.percent(util, scale=1):>5} ", style=f"bold {style}")
        ring = state.gpu_util.get(g.index)
        if ring is not None:
            t.append(fmt.sparkline(ring.values, spark_w, lo=0, hi=100), style=style)
        t.append("\n")
        t.append("     mem ", style="dim")
        mem = f"{fmt.nbytes(g.mem_used)}/{fmt.nbytes(g.mem_total)}" if g.mem_used is not None else fmt.NA
        t.append(f"{mem:<17} ")
        ring = state.gpu_mem.get(g.index)
        if ring is not None:
            t.append(fmt.sparkline(ring.values, spark_w, lo=0, hi=float(g.mem_total) if g.mem_total else None),
                     style="cyan")
        t.append("  trainer ", style="dim").append(fmt.nbytes(g.process_mem))
        if g.process_util is not None:  # NVML's per-process samples: its own kernels' share of the time
            t.append(f" {g.process_util:.0f}%")
        t.append("\n     ")
        t.append("power ", style="dim").append(f"{g.power_w:.0f}W" if g.power_w is not None else fmt.NA)
        t.append("  temp ", style="dim").append(f"{g.temp_c:.0f}C" if g.temp_c is not None else fmt.NA)
        t.append("  SM ", style="dim").append(f"{g.sm_clock_mhz:.0f}MHz" if g.sm_clock_mhz is not None else fmt.NA)
        if g.sm_active is not None:  # NVML GPM (Hopper+): busy SMs and tensor-core time, not just "a kernel ran"
            t.append("  SM active ", style="dim").append(fmt.percent(g.sm_active, scale=1))
            t.append("  tensor ", style="dim").append(fmt.percent(g.tensor_active, scale=1))
        for m in g.mig:
            t.append(f"\n     MIG{m.index} ", style="bold").append(f"{m.name[:24]} ")
            if m.cuda_index is not None:
                t.append(f"cuda:{m.cuda_index} ", style="dim")
            t.append(f"{fmt.nbytes(m.mem_used)}/{fmt.nbytes(m.mem_total)}" if m.mem_used is not None else fmt.NA)
    return t
