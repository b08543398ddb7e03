"""Benchmark: how much precision each tap keeps in an FP8 cache, one scale per token (the shared layout)
against one per token and tap (`dflash data cache --fp8-scales tap`).

The shared layout scales each token by its largest magnitude over every slot: the deepest layers, whose
residual stream is the largest and carries the outlier channels, set it, and an early tap's values then
use few of float8_e4m3fn's codes (below 2^-6 of the scale they lose mantissa bits; below 2^-9 they are
zero). No trained 8B target can be loaded here, so the states are synthetic, with the magnitudes
published for trained decoders (Sun et al., "Massive Activations in Large Language Models", 2024; the
growth of the residual stream with depth): per tap a Gaussian whose RMS grows geometrically from the
first tap to the last (``--rms_first`` .. ``--rms_last``), a few channels a fixed ``--outlier`` times that
RMS on every token, and on a ``--massive_share`` of the tokens (the first token, delimiters) two
channels of ``--massive`` magnitude from the second tap on. Both are printed per tap: the relative error
||x - fp8(x)|| / ||x|| of the bulk of its channels (all but the outlier ones, which keep their precision
in either layout and would hide the rest's loss) over ordinary tokens and over the massive ones, and the
bytes each layout takes.

    python scripts/bench_fp8_taps.py [--json] [--quick] [--tokens 4096] [--taps 6] [--hidden 4096] ...
"""

from __future__ import annotations

from _bench import ForeignLoad, bench_args, print_report

OPTIONS = {"tokens": (4096, "tokens"), "taps": (6, "slots per token: Qwen3-8B's 5 taps + the final state"),
           "hidden": (4096, "hidden size (Qwen3-8B's)"),
           "rms_first": (0.05, "RMS of the first tap's states"), "rms_last": (8.0, "RMS of the last slot's"),
           "outlier": (30.0, "outlier channels' magnitude, in multiples of their tap's RMS"),
           "massive": (3000.0, "massive activations' magnitude"),
           "massive_share": (0.01, "share of tokens that carry massive activations")}


def states(args):
    """[tokens, taps, hidden] float32 with the magnitudes the docstring describes, the massive tokens, and
    the bulk channels (not outliers)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.taps, args.hidden, generator=gen)
    growth = (args.rms_last / args.rms_first) ** (1 / max(1, args.taps - 1))
    rms = torch.tensor([args.rms_first * growth ** k for k in range(args.taps)])
    x *= rms[None, :, None]
    outliers = torch.randperm(args.hidden, generator=gen)[:4]
    x[:, :, outliers] = args.outlier * rms[None, :, None]
    massive = torch.rand(args.tokens, generator=gen) < args.massive_share
    massive[0] = True  # the first token always does
    x[massive.nonzero(), 1:, outliers[:2]] = args.massive
    bulk = torch.ones(args.hidden, dtype=torch.bool)
    bulk[outliers] = False
    return x, massive, bulk


def tap_errors(x, per_tap: bool, rows, bulk) -> list[float]:
    """Relative error per tap of ``x``'s FP8 round trip (dflash's own quantiser and reader), over ``rows``
    and the ``bulk`` channels."""
    import torch

    from dflash.data.cache_format import dequantize_fp8, quantize_fp8

    fp8, scales = quantize_fp8(x, per_tap=per_tap)
    back = dequantize_fp8(fp8, scales, torch.float32)
    x, back = x[rows][:, :, bulk], back[rows][:, :, bulk]
    err = (back - x).pow(2).sum(dim=(0, 2)).sqrt() / x.pow(2).sum(dim=(0, 2)).sqrt()
    return [round(float(e), 4) for e in err]


def main() -> None:
    args = bench_args(__doc__, OPTIONS, ("256 tokens, hidden 512 (a smoke run)", dict(tokens=256, hidden=512)))
    import torch

    from dflash.data.cache_format import FP8, cache_bytes

    torch.set_num_threads(1)
    x, massive, bulk = states(args)
    with ForeignLoad() as load:
        kinds = (("ordinary", ~massive), ("massive", massive))
        shared = {kind: tap_errors(x, False, rows, bulk) for kind, rows in kinds}
        per_tap = {kind: tap_errors(x, True, rows, bulk) for kind, rows in kinds}
    size = [cache_bytes([args.tokens], args.taps, args.hidden, FP8, tap) for tap in (False, True)]
    report = {"tokens": args.tokens, "taps": args.taps, "hidden": args.hidden,
              "massive_tokens": int(massive.sum()),
              "rel_error_shared_ordinary": shared["ordinary"], "rel_error_per_tap_ordinary": per_tap["ordinary"],
              "rel_error_shared_massive": shared["massive"], "rel_error_per_tap_massive": per_tap["massive"],
              "first_tap_error_ratio_ordinary": round(shared["ordinary"][0] / per_tap["ordinary"][0], 2),
              "first_tap_error_ratio_massive": round(shared["massive"][0] / per_tap["massive"][0], 2),
              "bytes_shared": size[0], "bytes_per_tap": size[1], "extra_bytes": round(size[1] / size[0] - 1, 5),
              "foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2}
    print_report(report, args.json)


if __name__ == "__main__":
    main()
