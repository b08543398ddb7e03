"""The token store (dflash/data/store.py, dflash/data/prepare.py): prepared once, read as load_samples would
read the JSONL, resumable, refused in one line when it does not fit the run or is damaged."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import screen_text

from dflash.data import load_samples
from dflash.data.prepare import open_store, prepare
from dflash.data.store import MANIFEST, StoreError, TokenStore, shard_paths
from dflash.targets.tiny import TINY_DIR

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a drafter block anchor token verify accept reject draft target hidden state layer mask".split()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_DIR))


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_rows(path: Path, rows: int = 240, seed: int = 0, bad: bool = True) -> Path:
    """Two-turn conversations and prompt rows of skewed lengths; with ``bad``, a malformed line, a row
    without an assistant turn and a blank line among them."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        answer = _text(rng, int(rng.paretovariate(1.2) * 12))
        if i % 3:
            lines.append(json.dumps({"messages": [{"role": "user", "content": _text(rng, 8)},
                                                  {"role": "assistant", "content": answer}]}))
        else:
            lines.append(json.dumps({"prompt": _text(rng, 6), "response": answer}))
    if bad:
        lines[5] = '{"messages": [oops'
        lines[17] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        lines[30] = ""
    path.write_text("\n".join(lines) + "\n")
    return path


def store_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("shard-*"))}


def as_lists(samples) -> list[tuple[list[int], list[int]]]:
    return [(list(map(int, s.input_ids)), list(map(int, s.loss_mask))) for s in samples]


def test_a_store_reads_the_samples_load_samples_reads_and_counts_what_it_skips(tmp_path, tok):
    data = write_rows(tmp_path / "d.jsonl")
    good = tmp_path / "good.jsonl"
    good.write_text("".join(x + "\n" for i, x in enumerate(data.read_text().splitlines()) if i not in (5, 17, 30)))
    said: list[str] = []
    m = prepare(data, tok, tmp_path / "s", max_seq_len=48, workers=0, shard_rows=64, log=said.append)
    store = TokenStore(tmp_path / "s", min_loss_tokens=4)
    assert as_lists(store) == as_lists(load_samples(good, tok, max_len=48, min_loss_tokens=4))
    assert store.lengths.dtype == np.int64 and list(store.lengths) == [len(s.input_ids) for s in store]
    skipped = m["counts"]["skipped"]
    assert skipped == {"not valid JSON": {"count": 1, "lines": [6]},
                       "'messages' has no assistant turn to learn from": {"count": 1, "lines": [18]}}
    assert m["counts"]["rows"] == 237 and len(m["shards"]) == 4
    assert "skipped 1 not valid JSON (line 6); 1 'messages' has no assistant turn" in said[-1]
    # a run's own shorter limit cuts at read time, the same as a store made at that limit
    short = TokenStore(tmp_path / "s", max_len=20, min_loss_tokens=4)
    assert as_lists(short) == as_lists(load_samples(good, tok, max_len=20, min_loss_tokens=4))
    with pytest.raises(StoreError, match=r"keeps rows up to 48 tokens, the run asks for --max-seq-len 64: prepare"):
        TokenStore(tmp_path / "s", max_len=64)


def test_the_truncation_counts_are_what_the_limit_cuts(tmp_path, tok):
    data = write_rows(tmp_path / "d.jsonl", bad=False)
    full = load_samples(data, tok, max_len=10**6, min_loss_tokens=0)
    prepare(data, tok, tmp_path / "s", max_seq_len=40, workers=0, log=lambda _: None)
    for limit in (40, 25):
        t = TokenStore(tmp_path / "s", max_len=limit, min_loss_tokens=3).truncation
        cut_sup = sum(sum(s.loss_mask[limit:]) for s in full)
        assert (t.rows, t.cut_rows) == (len(full), sum(len(s.input_ids) > limit for s in full))
        assert (t.supervised, t.cut_supervised) == (sum(sum(s.loss_mask) for s in full), cut_sup)
        assert t.too_few == sum(sum(s.loss_mask[:limit]) < 3 for s in full)
        assert t.cut_rows > 0 and f"limit {limit} cuts {t.cut_rows} of {len(full)} samples" in t.line()


def test_a_killed_prepare_resumes_to_the_same_store_and_is_never_read_as_whole(tmp_path, tok):
    data = write_rows(tmp_path / "d.jsonl")
    prepare(data, tok, tmp_path / "whole", max_seq_len=48, workers=0, shard_rows=40, log=lambda _: None)

    class Killed(Exception):
        pass

    def stop_after_two(index: int) -> None:
        if index == 1:
            raise Killed

    root = tmp_path / "resumed"
    with pytest.raises(Killed):
        prepare(data, tok, root, max_seq_len=48, workers=0, shard_rows=40, log=lambda _: None, on_shard=stop_after_two)
    p = shard_paths(root, 2)
    p["ids"].write_bytes(b"\x01" * 10)  # shard 2 was being written when the process died: files, no marker
    with pytest.raises(StoreError, match="is being prepared or was stopped .* run `dflash data prepare` to complete"):
        TokenStore(root)
    said: list[str] = []
    prepare(data, tok, root, max_seq_len=48, workers=0, shard_rows=999, log=said.append)  # the plan it began keeps
    assert "6 shards of 40 lines, resuming with 2 whole; encoding 4 in this process" in said[0]
    assert store_bytes(root) == store_bytes(tmp_path / "whole")
    assert as_lists(TokenStore(root)) == as_lists(TokenStore(tmp_path / "whole"))


def test_two_workers_write_the_store_one_process_writes(tmp_path, tok):
    data = write_rows(tmp_path / "d.jsonl")
    said: list[str] = []
    prepare(data, tok, tmp_path / "one", max_seq_len=48, workers=0, shard_rows=60, log=lambda _: None)
    prepare(data, tok, tmp_path / "two", max_seq_len=48, workers=2, shard_rows=60, log=said.append)
    assert "in 2 worker processes, each with 1 torch thread and 1 tokenizers thread" in said[0]
    assert store_bytes(tmp_path / "one") == store_bytes(tmp_path / "two") and len(store_bytes(tmp_path / "two")) == 16
    one, two = (json.loads((tmp_path / d / MANIFEST).read_text()) for d in ("one", "two"))
    assert one["counts"] == two["counts"] and one["stamp"] == two["stamp"]


def test_a_store_of_another_tokenizer_template_or_thinking_mode_is_refused(tmp_path, tok):
    from transformers import AutoTokenizer

    data = write_rows(tmp_path / "d.jsonl")
    prepare(data, tok, tmp_path / "s", max_seq_len=48, workers=0, log=lambda _: None)
    kw = dict(max_seq_len=48, min_loss_tokens=1)
    assert len(open_store(str(tmp_path / "s"), tok, **kw)) == 237
    with pytest.raises(StoreError, match=r"built with another thinking \(store auto, run off\); prepare it again"):
        open_store(str(tmp_path / "s"), tok, thinking="off", **kw)
    other = AutoTokenizer.from_pretrained(str(TINY_DIR))
    other.chat_template = other.chat_template.replace("<|im_end|>", "<|im_end|>\n")
    with pytest.raises(StoreError, match=r"built with another chat template \(store [0-9a-f]{12}, run [0-9a-f]{12}\)"):
        open_store(str(tmp_path / "s"), other, **kw)
    other = AutoTokenizer.from_pretrained(str(TINY_DIR))
    other.add_tokens(["<extra>"])
    with pytest.raises(StoreError, match=r"built with another tokenizer \(store"):
        open_store(str(tmp_path / "s"), other, **kw)


def test_a_truncated_or_garbled_store_is_refused_in_one_line(tmp_path, tok):
    data = write_rows(tmp_path / "d.jsonl")
    prepare(data, tok, tmp_path / "s", max_seq_len=48, workers=0, shard_rows=100, log=lambda _: None)
    root = tmp_path / "s"
    p = shard_paths(root, 1)
    ids = p["ids"].read_bytes()
    p["ids"].write_bytes(ids[:-8])
    with pytest.raises(StoreError, match=r"shard-00001.ids: [\d,]+ bytes where the manifest says [\d,]+ \(truncated"):
        TokenStore(root)
    p["ids"].write_bytes(ids)
    rows = np.fromfile(p["rows"], dtype="<i8").reshape(-1, 6)
    rows[3, 0] += 1_000_000  # an offset far past the ids: reading it would run off the map
    rows.tofile(p["rows"])
    with pytest.raises(StoreError, match=r"shard-00001.rows: the row table is garbled"):
        TokenStore(root)
    manifest = root / MANIFEST
    manifest.write_text('{"format": "dflash-token-store", "version": 1, "shards": 7')
    with pytest.raises(StoreError, match=r"manifest.json: the manifest does not read \(JSONDecodeError\)"):
        TokenStore(root)
    with manifest.open("w") as f:
        f.truncate(17 << 20)
    with pytest.raises(StoreError, match=r"the manifest is 17,825,792 bytes, more than"):
        TokenStore(root)


def test_only_one_process_prepares_and_the_others_wait_for_it(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", rows=400)
    code = ("import sys; from transformers import AutoTokenizer; from dflash.data.prepare import open_store; "
            f"t = AutoTokenizer.from_pretrained({str(TINY_DIR)!r}); "
            f"s = open_store({str(data)!r}, t, max_seq_len=48, min_loss_tokens=1, workers=0); print('samples', len(s))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("prepare: " in o for o in outs) == 1, outs  # one prepared (its two lines), the other only read
    assert [o.splitlines()[-1] for o in outs] == ["samples 397", "samples 397"]
    assert len(list((tmp_path / "d.jsonl.dflash-store").iterdir())) == 1


def test_the_gpu_recipe_trains_at_the_published_length(monkeypatch):
    import torch

    from dflash.train.config.recipes import hardware_recipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    recipe, line = hardware_recipe("tiny")
    assert recipe["max_seq_len"] == 3072 and "max_seq_len 3072" in line


def test_training_says_what_the_limit_cuts_in_the_log_the_snapshot_and_dflash_top(tmp_path, tok, capsys):
    from dflash.telemetry.wire.protocol import Snapshot
    from dflash.telemetry.wire.reader import read_frames
    from dflash.train.config.schema import make_config
    from dflash.train.trainer import train
    from dflash_tui.app import DFlashTop
    from dflash_tui.sources import MemorySource

    data = write_rows(tmp_path / "d.jsonl", bad=False)
    store = tmp_path / "store"
    prepare(data, tok, store, max_seq_len=64, workers=0, log=lambda _: None)
    run = tmp_path / "run"
    cfg = make_config({}, dict(data=str(store), run_dir=str(run), max_seq_len=24, batch_size=4, num_anchors=4,
                               drafter_layers=1, max_steps=1, eval_prompts=0, checkpoint_every=1e9,
                               socket_dir=str(tmp_path / "sock"), block_size=4, telemetry_interval=0.1))
    assert train(cfg) == 0
    cut = TokenStore(store, max_len=24, min_loss_tokens=4).truncation
    out = capsys.readouterr().out
    assert f"length: limit 24 cuts {cut.cut_rows} of 240 samples" in out
    last = [f for f in read_frames(run / "telemetry.jsonl") if isinstance(f, Snapshot)][-1]
    assert last.gauges["cut_samples"] == cut.cut_rows and last.gauges["max_seq_len"] == 24
    assert last.gauges["cut_supervised_share"] == pytest.approx(cut.cut_share)

    async def shown() -> str:
        frames = list(read_frames(run / "telemetry.jsonl"))
        app = DFlashTop(source=MemorySource(frames, path=run / "telemetry.jsonl"), pyspy_exe="py-spy")
        async with app.run_test(size=(200, 50)) as pilot:
            from test_tui_snapshots import settle

            await settle(pilot)
            return screen_text(app)

    assert f"len 24 cuts {cut.cut_rows} samples ({cut.cut_share:.1%} sup)" in asyncio.run(shown())


def test_prepare_renders_under_the_thinking_mode_and_warns_when_the_rows_disagree(tmp_path, tok):
    """Rows with reasoning prepared with thinking off: the reasoning is left out of what is trained (a
    different store from auto's, stamped so), and one line says how many rows disagree."""
    answers = {"add two numbers": "<think>they want a sum</think>def add(a, b): return a + b",
               "subtract": "def sub(a, b): ..."}
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in answers.items()]
    data = tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said: dict[str, list[str]] = {"off": [], "auto": []}
    stores = {mode: prepare(data, tok, tmp_path / mode, max_seq_len=256, thinking=mode, workers=0,
                            log=said[mode].append) for mode in ("off", "auto")}
    assert stores["off"]["counts"]["reasoning"] == 1 and stores["off"]["stamp"]["thinking"] == "off"
    warnings = [line for line in said["off"] if "warning" in line]
    assert len(warnings) == 1 and "1 of 2 rows carry reasoning but thinking is off" in warnings[0]
    assert not [line for line in said["auto"] if "warning" in line]
    off, auto = (TokenStore(tmp_path / mode) for mode in ("off", "auto"))
    decoded = {mode: tok.decode([int(t) for t, m in zip(s[0].input_ids, s[0].loss_mask, strict=True) if m])
               for mode, s in (("off", off), ("auto", auto))}
    assert "they want a sum" not in decoded["off"] and "def add" in decoded["off"]
    assert "they want a sum" in decoded["auto"]
