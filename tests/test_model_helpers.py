"""Builders shared by the model/eval/export tests: tiny random Hugging Face targets saved to disk.

(Named test_* so it sits with the files that use it; it holds no tests itself.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORDS = "def return import class self if else for in while print None True False lambda yield".split()


def make_tokenizer(mask_token: bool = True):
    """A word-level tokenizer over a few Python words, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<pad>"] + (["<mask>"] if mask_token else [])
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"mask_token": "<mask>"} if mask_token else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<pad>", **kwargs)


def make_target_dir(path: Path, arch: str = "qwen3", layers: int = 4, vocab: int = 300, hidden: int = 64,
                    tokenizer=None, seed: int = 0) -> Path:
    """save_pretrained a random tiny causal LM (and optionally a tokenizer) into ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, cfg_cls = {"qwen3": (Qwen3ForCausalLM, Qwen3Config), "llama": (LlamaForCausalLM, LlamaConfig)}[arch]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=1024, eos_token_id=1, bos_token_id=None, pad_token_id=2)
    torch.manual_seed(seed)
    model = cls(cfg)
    # A random init gives near-uniform logits; sharpen them so greedy decoding has clear winners and
    # tiny float differences between batch shapes cannot flip an argmax.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core box oversubscription made
    these tests ~5x slower; restored afterwards. Import it into a test module to use it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
