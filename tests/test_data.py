"""Data formats, loss masks, bad lines, prompts and regeneration with a real (tiny, random) target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.data import DataError, load_prompts, load_samples, resolve_data
from dflash.data.formats import encode_row
from dflash.targets.tiny_build import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.chat_template = CHAT_TEMPLATE.replace("<|im_start|>", "").replace("<|im_end|>", "")
    return t


def _lines(tmp_path: Path, *rows: str) -> Path:
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(rows) + "\n")
    return p


def test_prompt_response_masks_only_the_response(tok):
    s = encode_row({"prompt": "def return", "response": "class self if"}, tok, "x:1")
    assert tok.convert_ids_to_tokens(s.input_ids) == ["def", "return", "class", "self", "if"]
    assert s.loss_mask == [0, 0, 1, 1, 1]


def test_text_rows_are_all_trainable(tok):
    s = encode_row({"text": "for in while"}, tok, "x:1")
    assert s.loss_mask == [1, 1, 1]


def test_messages_mask_exactly_the_assistant_turns(tok):
    row = {"messages": [{"role": "user", "content": "def"}, {"role": "assistant", "content": "return None"},
                        {"role": "user", "content": "class"}, {"role": "assistant", "content": "yield"}]}
    s = encode_row(row, tok, "x:1")
    toks = tok.convert_ids_to_tokens(s.input_ids)
    assert len(toks) == len(s.loss_mask)
    trained = [t for t, m in zip(toks, s.loss_mask, strict=True) if m]
    # The assistant's words are trained; the user's never are.
    assert "return" in trained and "None" in trained and "yield" in trained
    assert "def" not in trained and "class" not in trained
    assert sum(s.loss_mask) < len(s.loss_mask)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "def"}', "needs both 'prompt' and 'response'"),
        ('{"prompt": "def", "response": 3}', "'response' must be a string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "user", "content": "def"}]}', "no assistant turn"),
        ('{"foo": 1}', "none of 'messages'"),
    ],
)
def test_a_bad_line_names_file_and_line(tmp_path, tok, line, reason):
    p = _lines(tmp_path, '{"text": "def return class"}', line)
    with pytest.raises(DataError) as e:
        load_samples(p, tok)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: ") and reason in msg and "\n" not in msg


def test_length_filter_and_truncation(tmp_path, tok):
    p = _lines(tmp_path, json.dumps({"prompt": "def " * 10, "response": "return " * 3}),
               json.dumps({"prompt": "def", "response": "return " * 30}))
    samples = load_samples(p, tok, max_len=16, min_loss_tokens=4)
    assert len(samples) == 1  # the first has only 3 trainable tokens
    assert len(samples[0].input_ids) == 16 and sum(samples[0].loss_mask) == 15


def test_missing_and_empty_files(tmp_path, tok):
    with pytest.raises(DataError, match="no such data file"):
        resolve_data(str(tmp_path / "nope.jsonl"))
    empty = _lines(tmp_path, "")
    with pytest.raises(DataError, match="no usable rows"):
        load_samples(empty, tok)


def test_prompts_for_evaluation(tmp_path, tok):
    p = _lines(tmp_path, json.dumps({"prompt": "def return", "response": "x"}),
               json.dumps({"messages": [{"role": "user", "content": "class"}, {"role": "assistant", "content": "x"}]}))
    prompts = load_prompts(str(p), tok, limit=5)
    assert tok.convert_ids_to_tokens(prompts[0]) == ["def", "return"]
    assert "class" in tok.convert_ids_to_tokens(prompts[1])
    with pytest.raises(DataError, match="no prompt to continue"):
        load_prompts(str(_lines(tmp_path, '{"text": "def"}')), tok, limit=1)


def test_regenerate_writes_the_targets_own_greedy_responses(tmp_path, tok):
    """`dflash data regenerate` end to end: each new response is what the target itself continues."""
    from dflash.data.formats import prompt_of
    from dflash.data.regenerate import generate_batch
    from dflash.targets import load_target

    target_dir = make_target_dir(tmp_path / "t", tokenizer=tok)
    chat = {"messages": [{"role": "user", "content": "class self"}, {"role": "assistant", "content": "old"}]}
    data = _lines(tmp_path, json.dumps({"prompt": "def return", "response": "old"}), json.dumps(chat),
                  json.dumps({"prompt": "for in while if", "response": "old"}))
    out = tmp_path / "regen.jsonl"
    proc = subprocess.run([sys.executable, "-m", "dflash", "data", "regenerate", "--target", str(target_dir),
                           "--data", str(data), "--out", str(out), "--max-new-tokens", "6", "--batch-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    new = [json.loads(x) for x in out.read_text().splitlines()]
    assert new[0]["prompt"] == "def return" and new[2]["prompt"] == "for in while if"
    assert new[1]["messages"][0] == chat["messages"][0] and new[1]["messages"][1]["role"] == "assistant"
    target = load_target(target_dir)
    for row, reply in zip(new, [new[0]["response"], new[1]["messages"][1]["content"], new[2]["response"]], strict=True):
        assert reply != "old"
        # Batched (left-padded) generation agrees with generating this prompt alone.
        alone = generate_batch(target, [prompt_of(row, target.tokenizer, "x")], 6)[0]
        assert reply == target.tokenizer.decode(alone, skip_special_tokens=True)


def test_regenerate_reports_bad_input_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dflash", "data", "regenerate", "--target", "tiny",
                           "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "missing.jsonl: no such data file (give a .jsonl path or 'demo')")
