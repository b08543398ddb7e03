"""The shipped default target and demo data: present, loadable as any HF model, and a real LM."""

from __future__ import annotations

import json

import torch
from test_model_helpers import one_thread  # noqa: F401

from dflash.data import load_prompts, load_samples, resolve_data
from dflash.data.demo import DEMO_EVAL_PATH, DEMO_PATH
from dflash.targets import load_target
from dflash.targets.tiny import tiny_target_dir
from dflash.targets.tiny_build import greedy_distinct, split_files, stdlib_files


def test_shipped_tiny_target_loads_without_building():
    path = tiny_target_dir()
    assert (path / "model.safetensors").stat().st_size <= 15 * 2**20
    t = load_target("tiny")
    assert t.config.model_type == "qwen3" and t.num_layers == 6
    assert t.tokenizer.mask_token_id == t.default_mask_token_id()
    assert t.tokenizer.chat_template and t.tokenizer.eos_token_id in t.stop_token_ids()


def test_build_info_meets_the_bar_for_a_real_language_model():
    info = json.loads((tiny_target_dir() / "build_info.json").read_text())
    assert info["heldout_loss"] <= 3.0, info["heldout_loss"]
    assert info["heldout_loss"] < info["bigram_heldout_loss"] - 1.0
    assert info["greedy_distinct_per_96"] >= 30  # greedy continuations vary (a looping model gets ~16)


def test_greedy_output_of_the_shipped_model_does_not_loop():
    """Re-measured here (not read from build_info): greedy continuations of unseen code vary."""
    from dflash.targets.tiny_build import TinyRecipe, encode_files

    t = load_target("tiny")
    _, held = split_files(stdlib_files(), TinyRecipe().heldout_every)
    ids = encode_files(t.tokenizer, held[:3])
    assert greedy_distinct(t.model, ids, prompts=3) >= 25


def test_demo_data_is_shipped_and_loads_with_the_tiny_tokenizer():
    assert resolve_data("demo") == DEMO_PATH and DEMO_PATH.exists() and DEMO_EVAL_PATH.exists()
    t = load_target("tiny")
    samples = load_samples(DEMO_PATH, t.tokenizer, max_len=320, min_loss_tokens=16)
    assert len(samples) >= 1000
    assert all(sum(s.loss_mask) >= 16 for s in samples[:50])
    prompts = load_prompts("demo", t.tokenizer, limit=8)
    assert len(prompts) == 8 and all(len(p) > 8 for p in prompts)
    # The evaluation prompts come from files the target never trained on.
    train_text = DEMO_PATH.read_text()
    first_eval = json.loads(DEMO_EVAL_PATH.read_text().splitlines()[0])["prompt"]
    assert first_eval not in train_text


def test_demo_responses_are_the_targets_own_greedy_text():
    """The recipe trains on target-written responses: check one row against a fresh greedy decode."""
    from dflash.data.regenerate import generate_batch

    t = load_target("tiny")
    row = json.loads(DEMO_PATH.read_text().splitlines()[0])
    prompt = t.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = generate_batch(t, [prompt], 32)[0]
    assert row["response"].startswith(t.tokenizer.decode(out[:24], skip_special_tokens=True)[:40])


def test_repeated_ngram_mask_marks_only_tokens_of_an_earlier_ngram():
    from dflash.targets.tiny_build import repeated_ngram_mask

    #        prefix | continuation: "1 2 3" repeats the prefix's 3-gram, then "7 8 9" is new
    seq = [1, 2, 3, 4, 1, 2, 3, 7, 8, 9]
    assert repeated_ngram_mask(seq, start=4, n=3) == [True, True, True, False, False, False]
    assert repeated_ngram_mask(seq, start=4, n=4) == [False] * 6
    assert repeated_ngram_mask([5] * 6, start=2, n=2) == [True] * 4  # a one-token loop


def test_unlikelihood_phase_lowers_the_probability_of_repeats(tmp_path):
    """On a model taught to loop, phase 2 makes its own repeated tokens less likely than the same
    schedule with the unlikelihood steps switched off (the objective hits the right tokens with the
    right sign)."""
    import copy

    import torch
    from test_model_helpers import make_target_dir
    from transformers import AutoModelForCausalLM

    from dflash.targets.tiny_build import TinyRecipe, lm_loss, repeated_ngram_mask, unlikelihood_finetune

    torch.manual_seed(0)
    looper = AutoModelForCausalLM.from_pretrained(make_target_dir(tmp_path / "m", layers=2))
    stream = torch.tensor([7, 8, 9] * 400)  # a corpus that teaches nothing but a loop
    opt = torch.optim.AdamW(looper.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        lm_loss(looper, stream, 32, 4, torch.Generator().manual_seed(1)).backward()
        opt.step()
    prefix = stream[:8].unsqueeze(0)
    with torch.no_grad():
        loop = looper.generate(prefix, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones_like(prefix))
    mask = torch.tensor(repeated_ngram_mask(loop[0].tolist(), 8, 4))
    assert mask.all(), loop  # it does loop

    def repeat_logprob(model) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=loop[:, :-1]).logits[0, 7:], -1)
        return float(logp.gather(-1, loop[0, 8:, None]).mean())

    def finetuned(ngram: int):
        model = copy.deepcopy(looper)
        recipe = TinyRecipe(seq_len=32, ul_batch=4, ul_prefix=8, ul_new_tokens=16, ul_steps=12, ul_lr=1e-2,
                            ul_ngram=ngram)
        unlikelihood_finetune(model, stream, recipe, torch.Generator().manual_seed(0), log=lambda s: None)
        return model

    with_ul = repeat_logprob(finetuned(4))
    mle_only = repeat_logprob(finetuned(10_000))  # no n-gram that long: every unlikelihood step is skipped
    assert with_ul < mle_only - 0.5, (with_ul, mle_only)  # measured: -0.94 vs -0.01
