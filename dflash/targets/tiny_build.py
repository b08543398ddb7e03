"""How the built-in tiny target (tiny.py) is made: a small Qwen3 language model that dflash trains itself.

Nothing can be downloaded where dflash runs its demo and tests, yet a drafter can only be judged against
a *real* language model: a target whose greedy output loops makes any drafter look good and hides
label-offset or context-leak bugs. So dflash ships a tiny Qwen3-architecture model with a byte-level BPE
tokenizer, both trained here on the Python standard library's own source (present wherever Python is),
saved with ``save_pretrained`` so it loads like any Hugging Face model (targets/hf.py).

``dflash target build-tiny`` rebuilds it (fixed seed); the result is committed as package data.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|pad|>"]
# A ChatML-style template so `{"messages": [...]}` data works on the tiny target like on Qwen models.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Directories of the standard library left out: installed third-party packages, vendored tools and
# generated codec tables. The test suite stays in: at ~17 MB it is most of the code there is, and a
# first build without it (2.6M tokens) overfit (train 2.3 vs held-out 3.15 nats) and looped greedily.
_SKIP_DIRS = {"idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "encodings"}


@dataclass
class TinyRecipe:
    vocab_size: int = 2048
    # Sized for the compute a 2-core CPU gives in under an hour (~10M tokens): a smaller model trained
    # on more tokens beats a larger one trained on fewer, and it keeps the drafter (whose width is the
    # target's) cheap enough to train on a CPU in minutes. Six layers so the tap layers can spread.
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 32
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 150
    weight_decay: float = 0.1
    steps: int = 6000
    max_time_s: float = 2400.0
    seed: int = 1234
    heldout_every: int = 40  # one file in this many (by path hash) is held out for evaluation
    # Phase 2, sequence-level unlikelihood (Welleck et al. 2019, "Neural Text Generation with
    # Unlikelihood Training"): maximum likelihood alone leaves a model this small looping under greedy
    # decoding (16 distinct tokens per 96 at 2.27 nats/token), so the build then alternates MLE steps
    # with steps that push down the probability of every token that repeats an n-gram the model's own
    # greedy continuation has already produced.
    ul_steps: int = 600  # updates, half of them MLE and half unlikelihood
    ul_lr: float = 3e-4
    ul_batch: int = 16
    ul_prefix: int = 48
    ul_new_tokens: int = 96
    ul_ngram: int = 4


def stdlib_files() -> list[Path]:
    """The standard library's own .py sources, sorted so every machine sees the same order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in _SKIP_DIRS for part in rel[:-1]) or p.stat().st_size > 400_000:
            continue
        files.append(p)
    return files


def split_files(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """Deterministic train/held-out split by a hash of the file's name relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in files:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(), 16)
        (held if h % every == 0 else train).append(p)
    return train, held


def read_text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (as GPT-2/Qwen use) so any text, in any encoding, round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_files(tokenizer, files: list[Path]):
    """All files as one token stream, documents separated by end-of-text."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for p in files:
        ids.extend(tokenizer(read_text(p), add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def bigram_loss(train_ids, held_ids, vocab: int) -> float:
    """Held-out nats/token of the best interpolated bigram model (bigram mixed with unigram, the mix
    chosen on the held-out set itself, so the baseline is if anything flattered): the bar a real
    language model must clear by a wide margin."""
    import torch

    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    counts.index_add_(0, train_ids[:-1] * vocab + train_ids[1:], torch.ones(len(train_ids) - 1, dtype=torch.float64))
    counts = counts.view(vocab, vocab)
    p_bi = counts / counts.sum(1, keepdim=True).clamp(min=1)
    uni = torch.bincount(train_ids, minlength=vocab).double() + 1
    p_uni = uni / uni.sum()
    prev, nxt = held_ids[:-1], held_ids[1:]
    return min(float(-(lam * p_bi[prev, nxt] + (1 - lam) * p_uni[nxt]).log().mean())
               for lam in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99))


def make_model(recipe: TinyRecipe, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def heldout_loss(model, held_ids, seq_len: int, max_windows: int | None = None) -> float:
    """Mean nats/token over consecutive windows of the held-out stream (all of it by default)."""
    import torch

    n = (len(held_ids) - 1) // seq_len
    n = n if max_windows is None else min(max_windows, n)
    x = held_ids[: n * seq_len].view(n, seq_len)
    y = held_ids[1 : n * seq_len + 1].view(n, seq_len)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 16):
            logits = model(input_ids=x[i : i + 16]).logits
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + 16].flatten(),
                                                             reduction="sum"))
    model.train()
    return total / (n * seq_len)


def greedy_distinct(model, held_ids, prompts: int = 16, prompt_len: int = 48, new_tokens: int = 96) -> float:
    """Mean number of distinct tokens in greedy continuations: low means the model loops."""
    import torch

    model.eval()
    stride = max(1, (len(held_ids) - prompt_len) // prompts)
    distinct = []
    with torch.no_grad():
        for i in range(prompts):
            prompt = held_ids[i * stride : i * stride + prompt_len].unsqueeze(0)
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            distinct.append(len(set(out[0, prompt_len:].tolist())))
    model.train()
    return sum(distinct) / len(distinct)


def lm_loss(model, train_ids, seq_len: int, batch: int, gen):
    """Next-token cross-entropy on `batch` random windows of the training stream."""
    import torch

    starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen)
    x = torch.stack([train_ids[s : s + seq_len] for s in starts])
    y = torch.stack([train_ids[s + 1 : s + seq_len + 1] for s in starts])
    return torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


def _update(model, opt, loss) -> None:
    """One optimiser step on `loss`, gradients clipped to norm 1 (both build phases)."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def repeated_ngram_mask(seq: list[int], start: int, n: int) -> list[bool]:
    """For positions start.. of seq: True where the token belongs to an n-gram that already occurred
    earlier in seq (the candidates sequence-level unlikelihood penalises)."""
    seen: set[tuple[int, ...]] = set()
    mask = [False] * len(seq)
    for i in range(len(seq) - n + 1):
        gram = tuple(seq[i : i + n])
        if gram in seen and i + n > start:
            for j in range(max(i, start), i + n):
                mask[j] = True
        seen.add(gram)
    return mask[start:]


def unlikelihood_finetune(model, train_ids, recipe: TinyRecipe, gen, log: Callable[[str], None]) -> None:
    """Alternate one MLE step with one sequence-level unlikelihood step on the model's own greedy
    continuations of training prefixes: loss -log(1 - p(x_t)) on each token inside a repeated n-gram."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=recipe.ul_lr, betas=(0.9, 0.95), weight_decay=0.0)
    T, B, P, N = recipe.seq_len, recipe.ul_batch, recipe.ul_prefix, recipe.ul_new_tokens
    t0 = time.time()
    rep_frac = []
    for step in range(recipe.ul_steps):
        if step % 2 == 0:
            loss = lm_loss(model, train_ids, T, B, gen)
        else:
            starts = torch.randint(0, len(train_ids) - P - 1, (B,), generator=gen)
            prefix = torch.stack([train_ids[s : s + P] for s in starts])
            model.eval()
            with torch.no_grad():
                seq = model.generate(prefix, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                     attention_mask=torch.ones_like(prefix))
            model.train()
            mask = torch.tensor([repeated_ngram_mask(row, P, recipe.ul_ngram) for row in seq.tolist()])
            rep_frac.append(float(mask.float().mean()))
            if not mask.any():
                continue
            logp = F.log_softmax(model(input_ids=seq[:, :-1]).logits[:, P - 1 :], dim=-1)
            p = logp.gather(-1, seq[:, P:].unsqueeze(-1)).squeeze(-1).exp()
            loss = -(torch.log1p(-p.clamp(max=1 - 1e-5)) * mask).sum() / mask.sum()
        _update(model, opt, loss)
        if (step + 1) % 50 == 0:
            recent = rep_frac[-25:]
            log(f"unlikelihood step {step + 1}/{recipe.ul_steps}: repeated-token share of greedy "
                f"continuations {sum(recent) / max(1, len(recent)):.2f} ({(time.time() - t0) / 60:.1f} min)")


def build_tiny(out_dir: Path, recipe: TinyRecipe, log: Callable[[str], None] = print) -> dict:
    """Train the tokenizer and the model, measure them, and save both (fp16) to out_dir."""
    import torch

    t_start = time.time()
    torch.manual_seed(recipe.seed)
    train_files, held_files = split_files(stdlib_files(), recipe.heldout_every)
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files")
    tokenizer = train_tokenizer(train_files, recipe.vocab_size)
    train_ids = encode_files(tokenizer, train_files)
    held_ids = encode_files(tokenizer, held_files)
    log(f"tokens: {len(train_ids):,} train, {len(held_ids):,} held out (vocab {len(tokenizer)})")
    bigram = bigram_loss(train_ids, held_ids, len(tokenizer))
    log(f"bigram baseline: {bigram:.3f} nats/token held out")

    model = make_model(recipe, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(recipe.seed)
    T, B = recipe.seq_len, recipe.batch_size
    t0 = time.time()
    step, tokens = 0, 0
    while True:
        progress = max(step / recipe.steps, (time.time() - t0) / recipe.max_time_s)
        if progress >= 1.0:
            break
        if step < recipe.warmup_steps:
            lr = recipe.lr * (step + 1) / recipe.warmup_steps
        else:
            lr = recipe.lr * (recipe.min_lr_ratio
                              + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        # fp32: on these CPUs bf16 autocast measured slower than plain fp32 for a model this small.
        loss = lm_loss(model, train_ids, T, B, gen)
        _update(model, opt, loss)
        step += 1
        tokens += B * T
        if step % 100 == 0:
            dt = time.time() - t0
            log(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {tokens / dt:,.0f} tok/s {dt / 60:.1f} min")
        if step % 1000 == 0:
            log(f"  held-out loss (first 64 windows) {heldout_loss(model, held_ids, T, max_windows=64):.3f}")

    info = {
        "recipe": asdict(recipe),
        "parameters": n_params,
        "steps": step,
        "train_tokens_seen": tokens,
        "corpus_train_tokens": len(train_ids),
        "corpus_heldout_tokens": len(held_ids),
        "bigram_heldout_loss": round(bigram, 4),
        "train_seconds": round(time.time() - t0, 1),
    }
    log(f"maximum likelihood done: held-out (first 64 windows) {heldout_loss(model, held_ids, T, max_windows=64):.3f}")
    return _finish(model, tokenizer, train_ids, out_dir, recipe, gen, info, t_start, log)


def refine_tiny(src_dir: Path, out_dir: Path, recipe: TinyRecipe, log: Callable[[str], None] = print) -> dict:
    """Phase 2 alone, on a model phase 1 already made (its build_info.json is carried over): how the
    shipped model was made from the previous release's weights without repeating the 40-minute phase 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    torch.manual_seed(recipe.seed)
    prior = json.loads((src_dir / "build_info.json").read_text()) if (src_dir / "build_info.json").exists() else {}
    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    train_files, _ = split_files(stdlib_files(), recipe.heldout_every)
    train_ids = encode_files(tokenizer, train_files)
    info = {k: v for k, v in prior.items() if k not in ("heldout_loss", "heldout_loss_per_file",
                                                        "greedy_distinct_per_96", "unlikelihood", "build_seconds")}
    info["phase1_from"] = str(src_dir)
    info["phase1_measured"] = {k: prior[k] for k in ("heldout_loss", "greedy_distinct_per_96") if k in prior}
    info["recipe"] = asdict(recipe)
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    return _finish(model, tokenizer, train_ids, out_dir, recipe, gen, info, t_start, log)


def _finish(model, tokenizer, train_ids, out_dir: Path, recipe: TinyRecipe, gen, info: dict, t_start: float,
            log: Callable[[str], None]) -> dict:
    """Phase 2 (unlikelihood), then save fp16 and measure what was saved."""
    import torch

    t0 = time.time()
    if recipe.ul_steps > 0:
        unlikelihood_finetune(model, train_ids, recipe, gen, log)
    info["unlikelihood"] = {"steps": recipe.ul_steps, "seconds": round(time.time() - t0, 1)}
    out_dir.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info.update({"python": sys.version.split()[0], "torch": torch.__version__, **measure_shipped(out_dir, recipe)})
    info["build_seconds"] = round(time.time() - t_start, 1)
    log(f"final: held-out {info['heldout_loss']:.3f} nats/token (bigram {info.get('bigram_heldout_loss')}), "
        f"greedy distinct {info['greedy_distinct_per_96']:.1f}/96")
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def measure_shipped(out_dir: Path, recipe: TinyRecipe) -> dict:
    """Held-out loss (every held-out token, per file too) and greedy variety of the model *as saved*
    (fp16 weights loaded back), so the figures describe exactly what ships."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    _, held_files = split_files(stdlib_files(), recipe.heldout_every)
    held_ids = encode_files(tokenizer, held_files)
    per_file = {}
    for p in held_files:
        ids = encode_files(tokenizer, [p])
        if len(ids) > recipe.seq_len:
            per_file[p.name] = round(heldout_loss(model, ids, recipe.seq_len), 3)
    return {
        "heldout_loss": round(heldout_loss(model, held_ids, recipe.seq_len), 4),
        "heldout_loss_per_file": per_file,
        "greedy_distinct_per_96": round(greedy_distinct(model, held_ids), 2),
    }
