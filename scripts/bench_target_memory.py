"""Benchmark: the bytes an in-process target keeps alive during its forward, at Qwen3-8B's layer shapes.

The target's forward feeds the drafter its tap layers' states. Asking transformers for
``output_hidden_states`` keeps every layer's output until the forward ends; dflash's ``tap_states``
keeps the tap layers' alone (forward hooks, dflash/targets/hf.py). On a GPU the drafter shares, that
difference is memory the drafter's batch cannot have. Measured on the CPU: a random-weight target with
Qwen3-8B's layer shapes (hidden 4,096, 32 heads of 128, 8 KV heads, MLP 12,288; fewer layers and a
small vocabulary, which change neither state's size), bf16, one sequence. At the last layer's input
(the deepest point, where the most is kept) every live tensor outside the model's own parameters is
counted, storage by storage: what the forward keeps then, beside the activations of the layer running.

    python scripts/bench_target_memory.py [--json] [--quick] [--layers 8] [--tokens 4096] [--hidden 4096]
"""

from __future__ import annotations

import gc
import warnings

from _bench import ForeignLoad, bench_args, print_report


def layer_shape(hidden: int) -> dict:
    """Qwen3-8B's layer proportions at width ``hidden`` (4,096: Qwen3-8B's own): MLP 3x, heads of 128, 4
    query heads per KV head."""
    heads = max(1, hidden // 128)
    return dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 4), head_dim=128)


def live_bytes(exclude: set[int]) -> int:
    """Bytes of the distinct storages of every live tensor not in ``exclude`` (storage pointers)."""
    import torch

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = storage.nbytes()
    return sum(seen.values())


def kept_at_last_layer(target, ids, taps: bool) -> int:
    """Live bytes at the last layer's input during one forward: ``taps`` dflash's tap_states, else a
    forward with ``output_hidden_states`` (every layer's output, then the taps picked from it)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in target.model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in target.model.buffers()}
    params.add(ids.untyped_storage().data_ptr())
    seen: list[int] = []
    last = target.model.get_decoder().layers[-1]
    hook = last.register_forward_pre_hook(lambda m, a: seen.append(live_bytes(params)))
    try:
        with torch.no_grad():
            if taps:
                target.tap_states(ids)
            else:
                target.taps(target.model.get_decoder()(input_ids=ids, output_hidden_states=True,
                                                       use_cache=False).hidden_states)
    finally:
        hook.remove()
    return seen[0]


OPTIONS = {"layers": (8, "target layers"), "tokens": (4096, "tokens in the sequence"),
           "hidden": (4096, "hidden size (Qwen3-8B's: 4,096)"),
           "draft_layers": (5, "drafter layers: one tap each, by the reference's rule")}


def main() -> None:
    args = bench_args(__doc__, OPTIONS, ("a 4-layer, 512-wide target at 256 tokens (a smoke run)",
                                         dict(layers=4, tokens=256, draft_layers=2, hidden=512)))
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.model.drafter import default_target_layer_ids
    from dflash.targets.hf import HFTarget

    torch.set_num_threads(2)  # the machine's two cores: a forward at 4,096 tokens, nothing else running
    torch.manual_seed(0)
    config = Qwen3Config(**layer_shape(args.hidden), num_hidden_layers=args.layers, vocab_size=1024)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)
    layer_ids = default_target_layer_ids(args.layers, args.draft_layers)
    target = HFTarget(model, None, layer_ids)
    ids = torch.randint(0, 1024, (1, args.tokens))
    state = args.tokens * args.hidden * 2  # one layer's output, bf16
    with ForeignLoad() as load:
        every = kept_at_last_layer(target, ids, taps=False)
        taps = kept_at_last_layer(target, ids, taps=True)
    report = {"layers": args.layers, "tokens": args.tokens, "hidden": args.hidden, "taps": layer_ids,
              "one_state_mib": round(state / 2**20, 1),
              "kept_mib_output_hidden_states": round(every / 2**20, 1), "kept_mib_tap_hooks": round(taps / 2**20, 1),
              "saved_mib": round((every - taps) / 2**20, 1),
              "saved_states": round((every - taps) / state, 2),
              "foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2}
    print_report(report, args.json)


if __name__ == "__main__":
    main()
