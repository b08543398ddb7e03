"""Loss masks from the published chat templates of real model families (tests/fixtures/chat_templates/).

Each template renders with the tiny target's real byte-level tokenizer, to which the family's special
tokens are added (as special tokens, so an end-of-turn marker is one token as in the real model). The
assertions read the trained tokens back as text: every contiguous trained run must be exactly one
assistant turn's writing and the token that ends it, whatever headers, system blocks and reasoning
scaffolding the template puts around it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.data.formats import (
    DataError,
    Sample,
    carries_reasoning,
    encode_row,
    prompt_of,
    thinking_mismatch,
)
from dflash.targets.tiny import tiny_target_dir

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# Per family: its template file, special tokens (end-of-turn markers among them), tokens the real
# tokenizer has as plain added tokens, and its BOS text (templates that start with bos_token).
FAMILIES = {
    "qwen3": dict(file="qwen3.jinja", special=["<|im_start|>", "<|im_end|>"], plain=["<think>", "</think>"],
                  bos=None),
    "llama3": dict(file="llama3.jinja", special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                   plain=[], bos="<|begin_of_text|>"),
    "gpt-oss": dict(file="gpt-oss.jinja", special=["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                   "<|return|>", "<|call|>", "<|constrain|>"],
                    plain=[], bos=None),
    "gemma4": dict(file="gemma4.jinja", special=["<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
                                                 "<channel|>"], plain=[], bos="<bos>"),
    "deepseek-v3.1": dict(file="deepseek-v3.1.jinja", special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                                               "<｜User｜>", "<｜Assistant｜>"],
                          plain=["<think>", "</think>"], bos="<｜begin▁of▁sentence｜>"),
}
# The token that ends an assistant turn: (earlier turns, the last turn). Harmony ends the conversation's
# last turn with <|return|> and every earlier one with <|end|>.
EOT = {"qwen3": ("<|im_end|>",) * 2, "llama3": ("<|eot_id|>",) * 2, "gpt-oss": ("<|end|>", "<|return|>"),
       "gemma4": ("<turn|>",) * 2, "deepseek-v3.1": ("<｜end▁of▁sentence｜>",) * 2}

ISSUE_ROW = {"messages": [
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now make it subtract."},
    {"role": "assistant", "content": "def sub(a, b): ..."},
]}
SYSTEM = {"role": "system", "content": "You are a terse Python tutor."}
REASONING = "The user wants subtraction, so swap the operator."


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    out = {}
    for name, fam in FAMILIES.items():
        tok = AutoTokenizer.from_pretrained(tiny_target_dir())
        tok.add_tokens(fam["special"], special_tokens=True)
        tok.add_tokens(fam["plain"])
        if fam["bos"]:
            tok.bos_token = fam["bos"]
        tok.chat_template = (TEMPLATES / fam["file"]).read_text(encoding="utf-8")
        out[name] = tok
    return out


def trained_runs(tok, s: Sample) -> list[str]:
    """The trained tokens as text, one string per contiguous run."""
    runs, cur = [], []
    for i, m in zip(s.input_ids, s.loss_mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


def with_last(row: dict, **fields) -> dict:
    msgs = [dict(m) for m in row["messages"]]
    msgs[-1].update(fields)
    return {"messages": msgs}


def test_the_issues_qwen3_two_turn_case(tokenizers):
    tok = tokenizers["qwen3"]
    # Why rendering turn by turn is wrong here: the first answer rendered last carries an empty think
    # block that the whole conversation does not, so the conversation is not its prefixes joined.
    one_turn = tok.apply_chat_template(ISSUE_ROW["messages"][:2], tokenize=False)
    assert "<think>\n\n</think>" in one_turn
    assert not tok.apply_chat_template(ISSUE_ROW["messages"], tokenize=False).startswith(one_turn)
    s = encode_row(ISSUE_ROW, tok, "x:1")
    assert trained_runs(tok, s) == ["def add(a, b):\n    return a + b<|im_end|>", "def sub(a, b): ...<|im_end|>"]


@pytest.mark.parametrize("thinking", ["auto", "on", "off"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_multi_turn_with_a_system_prompt_trains_exactly_the_assistant_turns(tokenizers, family, thinking):
    tok = tokenizers[family]
    row = {"messages": [SYSTEM, *ISSUE_ROW["messages"]]}
    s = encode_row(row, tok, "x:1", thinking=thinking)
    assert len(s.input_ids) == len(s.loss_mask)
    early, last = EOT[family]
    assert trained_runs(tok, s) == ["def add(a, b):\n    return a + b" + early, "def sub(a, b): ..." + last]


# What each template does with the last turn's reasoning_content when thinking is on: Qwen3 and
# Harmony render it (and the scaffolding the target writes between reasoning and answer is learnt with
# it); the others have no place for it, so only the answer is learnt.
REASONED_LAST = {
    "qwen3": REASONING + "\n</think>\n\ndef sub(a, b): ...<|im_end|>",
    "gpt-oss": REASONING + "<|end|><|start|>assistant<|channel|>final<|message|>def sub(a, b): ...<|return|>",
    "llama3": "def sub(a, b): ...<|eot_id|>",
    "gemma4": "def sub(a, b): ...<turn|>",
    "deepseek-v3.1": "def sub(a, b): ...<｜end▁of▁sentence｜>",
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reasoning_content_is_learnt_where_the_template_renders_it(tokenizers, family):
    tok = tokenizers[family]
    row = with_last(ISSUE_ROW, reasoning_content=REASONING)
    runs = trained_runs(tok, encode_row(row, tok, "x:1", thinking="on"))
    assert runs == ["def add(a, b):\n    return a + b" + EOT[family][0], REASONED_LAST[family]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_thinking_off_renders_no_reasoning(tokenizers, family):
    tok = tokenizers[family]
    for row in (with_last(ISSUE_ROW, reasoning_content=REASONING),
                with_last(ISSUE_ROW, content=f"<think>{REASONING}</think>def sub(a, b): ...")):
        s = encode_row(row, tok, "x:1", thinking="off")
        assert "swap the operator" not in tok.decode(s.input_ids)
        early, last = EOT[family]
        assert trained_runs(tok, s) == ["def add(a, b):\n    return a + b" + early, "def sub(a, b): ..." + last]


def test_qwen3_renders_reasoning_content_even_with_thinking_disabled(tokenizers):
    """Why thinking off drops the reasoning itself instead of trusting enable_thinking=False."""
    tok = tokenizers["qwen3"]
    row = with_last(ISSUE_ROW, reasoning_content=REASONING)
    assert REASONING in tok.apply_chat_template(row["messages"], tokenize=False, enable_thinking=False)


@pytest.mark.parametrize("family, last", [
    # Qwen3 splits the block off and renders it as its own reasoning.
    ("qwen3", REASONING + "\n</think>\n\ndef sub(a, b): ...<|im_end|>"),
    # Llama renders the content as written: the block is part of what the model writes.
    ("llama3", f"<think>{REASONING}</think>def sub(a, b): ...<|eot_id|>"),
    # DeepSeek-V3.1 keeps only what follows </think>.
    ("deepseek-v3.1", "def sub(a, b): ...<｜end▁of▁sentence｜>"),
])
def test_a_think_block_inside_the_content(tokenizers, family, last):
    tok = tokenizers[family]
    row = with_last(ISSUE_ROW, content=f"<think>{REASONING}</think>def sub(a, b): ...")
    runs = trained_runs(tok, encode_row(row, tok, "x:1"))
    assert runs == ["def add(a, b):\n    return a + b" + EOT[family][0], last]


def test_qwen3_drops_reasoning_of_turns_before_the_last_question(tokenizers):
    tok = tokenizers["qwen3"]
    msgs = [dict(m) for m in ISSUE_ROW["messages"]]
    msgs[1]["reasoning_content"] = "Adding is the plus operator."
    msgs[3]["reasoning_content"] = REASONING
    runs = trained_runs(tok, encode_row({"messages": msgs}, tok, "x:1", thinking="on"))
    assert runs == ["def add(a, b):\n    return a + b<|im_end|>",
                    REASONING + "\n</think>\n\ndef sub(a, b): ...<|im_end|>"]


def test_an_answer_that_repeats_the_question_is_found_in_the_answer(tokenizers):
    tok = tokenizers["qwen3"]
    row = {"messages": [{"role": "user", "content": "Say: return a + b"},
                        {"role": "assistant", "content": "return a + b"}]}
    s = encode_row(row, tok, "x:1")
    assert trained_runs(tok, s) == ["return a + b<|im_end|>"]
    # The trained run is the answer's, after the assistant header, not the copy in the question.
    header = len(s.input_ids) - 1 - s.input_ids[::-1].index(tok.convert_tokens_to_ids("<|im_start|>"))
    assert s.loss_mask.index(1) > header


def test_a_template_that_rewrites_the_answer_is_a_clear_error(tokenizers):
    tok = tokenizers["qwen3"]
    rewriting = tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
                             "{% endfor %}")
        with pytest.raises(DataError) as e:
            encode_row(ISSUE_ROW, tok, "d.jsonl:7")
    finally:
        tok.chat_template = rewriting
    msg = str(e.value)
    assert msg.startswith("d.jsonl:7: messages[1] (assistant)") and "verbatim" in msg and "\n" not in msg


def test_a_template_error_is_a_data_error(tokenizers):
    tok = tokenizers["gpt-oss"]
    row = with_last(ISSUE_ROW, content="<|channel|>final<|message|>hi")
    with pytest.raises(DataError, match=r"^x:1: the chat template cannot render this row \(TemplateError"):
        encode_row(row, tok, "x:1")


@pytest.mark.parametrize("family, thinking", [("qwen3", "off"), ("llama3", "auto"), ("deepseek-v3.1", "off")])
def test_the_prompt_is_what_precedes_the_first_answer(tokenizers, family, thinking):
    """Where the template renders a served prompt as the start of the conversation, prompt_of is exactly
    the untrained text before the first trained token (as text: the tiny tokenizer's GPT-2 split of
    whitespace tokenizes a trailing "\n\n" alone differently from "\n\n" before a word)."""
    tok = tokenizers[family]
    row = {"messages": [SYSTEM, *ISSUE_ROW["messages"][:2]]}
    s = encode_row(row, tok, "x:1", thinking=thinking)
    first = s.loss_mask.index(1)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    assert decode(prompt_of(row, tok, "x:1", thinking=thinking)) == decode(s.input_ids[:first])


def test_prompt_follows_the_thinking_mode(tokenizers):
    tok = tokenizers["qwen3"]
    on = tok.decode(prompt_of(ISSUE_ROW, tok, "x", thinking="on"))
    off = tok.decode(prompt_of(ISSUE_ROW, tok, "x", thinking="off"))
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="thinking must be one of auto, on, off"):
        encode_row(ISSUE_ROW, tok, "x", thinking="yes")


def test_carries_reasoning():
    assert not carries_reasoning(ISSUE_ROW)
    assert carries_reasoning(with_last(ISSUE_ROW, reasoning_content="why"))
    assert carries_reasoning(with_last(ISSUE_ROW, thinking="why"))
    assert carries_reasoning(with_last(ISSUE_ROW, content="<think>why</think>answer"))
    assert not carries_reasoning(with_last(ISSUE_ROW, content="<think>\n\n</think>answer"))
    assert not carries_reasoning(with_last(ISSUE_ROW, reasoning_content=""))
    assert carries_reasoning({"prompt": "q", "response": "<think>why</think>a"})
    assert not carries_reasoning({"prompt": "q", "response": "a"}) and not carries_reasoning({"text": "t"})


def test_thinking_mismatch_warns_in_one_line_with_the_count():
    assert thinking_mismatch(100, 0, "off") is None and thinking_mismatch(100, 100, "on") is None
    assert thinking_mismatch(100, 40, "auto") is None
    off = thinking_mismatch(100, 40, "off")
    on = thinking_mismatch(100, 40, "on")
    assert off.startswith("40 of 100 rows carry reasoning but thinking is off") and "\n" not in off
    assert on.startswith("60 of 100 rows carry no reasoning but thinking is on") and "\n" not in on
