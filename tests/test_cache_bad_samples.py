"""Bad sample files in a hidden-states cache (`dflash data cache` wrote it, then files were damaged):
each is skipped, named once in one line, counted in the telemetry and dflash-top, and the run stops only
past --max-bad-samples; a skipped row is masked out of its batch so that the step is the step on the
batch without it."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import demo_cache, screen_text, train_following

from dflash.cli import main
from dflash.data.cache_format import SIDECAR, CacheError, read_sample, sample_path, write_sample
from dflash.data.cache_reader import PROBE_FILES
from dflash.model.blocks import plan_blocks
from dflash.targets.base import TargetError
from dflash.targets.cache import SHARE_AFTER, load_cache_target
from dflash.train.config import ConfigError, TrainConfig
from dflash.train.config.schema import make_config, updated
from dflash.train.distributed import Dist
from dflash.train.run.build import build
from dflash.train.run.stages import Batch, BatchSource

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
TAPS = [1, 3, 5]
ROWS = 24  # rows of the cache (the demo lines it is written from: one is too short to train on)
LINES = 25


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The tiny target's cache of the first demo rows, as `dflash data cache` writes it."""
    return demo_cache(tmp_path_factory.mktemp("badsamples"), LINES, ",".join(map(str, TAPS)))


# --- ways a file goes bad, and the words its line gives for each ----------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-64])


def _header_length(path: Path) -> None:
    """The 8-byte header length overwritten: the error of the issue ("truncated or not a safetensors file")."""
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[9:8 + n] = b"#" * (n - 1)  # the JSON's opening brace kept, the rest noise
    path.write_bytes(bytes(data))


def _rewrite(path: Path, change) -> None:
    hs, ids = read_sample(path)
    hs, ids = change(hs.clone(), ids.clone())
    write_sample(path, hs, ids)


def _nan(path: Path) -> None:
    def change(hs, ids):
        hs[1, 0, 2] = float("nan")
        return hs, ids
    _rewrite(path, change)


def _wide(path: Path) -> None:
    _rewrite(path, lambda hs, ids: (hs.repeat(1, 1, 2), ids))


def _other_tokens(path: Path) -> None:
    _rewrite(path, lambda hs, ids: (hs, ids.flip(0)))


DAMAGE = {
    "truncated": (_truncate, "truncated ("),
    "header length": (_header_length, "truncated or not a safetensors file (header of 1099511627776 bytes"),
    "garbled header": (_garble_header, "unreadable safetensors header"),
    "nan": (_nan, "1 non-finite values (NaN/inf) in layer slots [0]"),
    "wrong shape": (_wide, "the cache's others are [seq, 4, "),
    "other tokens": (_other_tokens, "its token_ids differ from row"),
}


def damaged(cache: Path, dst: Path, rows: dict[int, str]) -> Path:
    """A copy of ``cache`` with file ``row`` damaged the way ``rows[row]`` names."""
    shutil.copytree(cache, dst)
    for row, how in rows.items():
        DAMAGE[how][0](sample_path(dst, row))
    return dst


def cache_target(root: Path, max_bad: int = 100):
    lines: list[str] = []
    target = load_cache_target(root, "tiny", TAPS, None, torch.device("cpu"), log=lambda s: None,
                               max_bad_samples=max_bad)
    target.on_bad_sample(lines.append)
    return target, lines


def in_order(target, batch_size: int = 8) -> BatchSource:
    """Batches of the cache's rows in file order (batch 0: rows 0-7, ...)."""
    samples = target.own_samples(256, 4)
    assert target.file_rows == list(range(ROWS))  # every row long enough: sample position = file row
    return BatchSource(samples, batch_size, 0, 0, block_size=4, num_anchors=8, in_order_first=True)


# --- the reader's side --------------------------------------------------------------------------

def test_each_kind_of_bad_file_is_skipped_named_once_and_the_rest_read(cache, tmp_path):
    bad = dict(enumerate(DAMAGE, start=1))  # rows 1-6, one way each; rows 0 and 7 whole
    root = damaged(cache, tmp_path / "bad", bad)
    target, lines = cache_target(root)
    clean, _ = cache_target(cache)
    try:
        batch = in_order(target)(0)
        hidden = target.hidden_states(batch)
        assert target.skipped_rows(batch) == list(bad)
        assert not hidden[list(bad)].any()  # nothing of a bad file gets in, NaN included
        torch.testing.assert_close(hidden[[0, 7]], clean.hidden_states(batch)[[0, 7]], rtol=0, atol=0)
        # one line each, in the order met: the count so far, the limit, the file and what is wrong with it
        assert len(lines) == len(bad)
        for n, (line, (row, how)) in enumerate(zip(lines, bad.items(), strict=True), start=1):
            assert line.startswith(f"bad sample skipped ({n} of at most 100, --max-bad-samples): "
                                   f"{sample_path(root, row)}: "), line
            assert DAMAGE[how][1] in line and "\n" not in line, line
        # the next epoch meets them again: skipped without a second read, a second line or a second count
        again = target.hidden_states(batch)
        assert target.skipped_rows(batch) == list(bad) and len(lines) == len(bad) == len(target.bad)
        torch.testing.assert_close(again, hidden, rtol=0, atol=0)
    finally:
        target.close()
        clean.close()


def test_past_the_limit_the_read_stops_with_one_line(cache, tmp_path):
    root = damaged(cache, tmp_path / "bad", {2: "truncated", 5: "nan", 6: "header length"})
    target, lines = cache_target(root, max_bad=2)
    try:
        with pytest.raises(CacheError) as e:
            target.hidden_states(in_order(target)(0))
        assert str(e.value) == (f"--hidden-states {root}: 3 bad sample files, more than --max-bad-samples 2; the "
                                f"latest: {sample_path(root, 6)}: truncated or not a safetensors file (header of "
                                f"1099511627776 bytes in a {sample_path(root, 6).stat().st_size}-byte file); delete "
                                "it and rerun `dflash data cache` (or the engine) to rewrite it")
        assert len(lines) == 2
    finally:
        target.close()
    # 0: the first bad file stops, in its own words, saying how to skip instead
    target, lines = cache_target(root, max_bad=0)
    try:
        with pytest.raises(CacheError) as e:
            target.hidden_states(in_order(target)(0))
        assert str(e.value).startswith(f"{sample_path(root, 2)}: truncated (")
        assert str(e.value).endswith("; or let --max-bad-samples N skip up to N such files") and not lines
    finally:
        target.close()


def test_a_cache_most_of_whose_files_are_bad_stops_whatever_the_limit(cache, tmp_path):
    """Not a few bad samples but a broken cache (a failed copy): once SHARE_AFTER files were tried and the
    bad outnumber the good, the run stops, even under a limit that would allow them all."""
    root = damaged(cache, tmp_path / "bad", {i: "truncated" for i in range(1, ROWS)})
    target, lines = cache_target(root, max_bad=1000)
    source = in_order(target)
    try:
        target.hidden_states(source(0))  # 7 bad of 8 tried: too few tries to blame the cache
        assert len(lines) == 7 and SHARE_AFTER == 16
        with pytest.raises(CacheError) as e:
            target.hidden_states(source(1))
        assert str(e.value).startswith(f"--hidden-states {root}: 15 of the 16 sample files read so far do not "
                                       f"read (the latest: {sample_path(root, 15)}: truncated (")
        assert str(e.value).endswith("the cache as a whole is broken or not the one written for --target; check "
                                     "it, or write it again with `dflash data cache`")
    finally:
        target.close()


def test_without_a_sidecar_a_bad_first_file_is_a_bad_sample_not_the_end(cache, tmp_path):
    """A cache an engine wrote (no sidecar) takes its shapes from its first file that reads: a bad hs_0 is
    skipped when training reaches it, like any other bad file, and the line said at the start names the
    file the shapes came from. A cache none of whose first PROBE_FILES files read does not start."""
    root = damaged(cache, tmp_path / "bad", {0: "truncated", 1: "garbled header"})
    (root / SIDECAR).unlink()
    said: list[str] = []
    target = load_cache_target(root, "tiny", TAPS, None, torch.device("cpu"), log=said.append, max_bad_samples=100)
    lines: list[str] = []
    target.on_bad_sample(lines.append)
    clean, _ = cache_target(cache)
    try:
        assert target.layout.shapes_from == "hs_2.safetensors" and len(said) == 1
        assert said[0].endswith("(shapes from hs_2.safetensors: the 2 before it do not read, and training skips "
                                "them as bad samples)")
        batch = in_order(target)(0)
        hidden = target.hidden_states(batch)
        assert target.skipped_rows(batch) == [0, 1] and len(lines) == 2
        assert lines[0].startswith(f"bad sample skipped (1 of at most 100, --max-bad-samples): {sample_path(root, 0)}: "
                                   "truncated (")
        torch.testing.assert_close(hidden[2:], clean.hidden_states(batch)[2:], rtol=0, atol=0)
    finally:
        target.close()
        clean.close()
    for row in range(2, PROBE_FILES):
        _truncate(sample_path(root, row))
    with pytest.raises(TargetError) as e:
        load_cache_target(root, "tiny", TAPS, None, torch.device("cpu"), log=said.append)
    assert str(e.value).startswith(f"--hidden-states {root}: none of its first {PROBE_FILES} sample files reads, so "
                                   f"the cache's shapes are unknown (the first: {sample_path(root, 0)}: truncated (")


# --- the batch: a skipped row is not trained on --------------------------------------------------

def lines_of(root: Path, row: int) -> str:
    """What the run says of row ``row``'s file made NaN (the first bad sample of a run)."""
    return (f"bad sample skipped (1 of at most 100, --max-bad-samples): {sample_path(root, row)}: 1 non-finite "
            "values (NaN/inf) in layer slots [0]; delete it and rerun `dflash data cache` (or the engine) to "
            "rewrite it")


def test_a_batch_with_a_skipped_row_trains_as_the_batch_without_it(cache, tmp_path):
    """The masked batch's loss and every gradient equal those of the batch built without the bad row
    (same anchors for the others), and not those of the batch that kept the row's zeros."""
    root = damaged(cache, tmp_path / "bad", {2: "nan"})
    target, _ = cache_target(root)
    clean, _ = cache_target(cache)
    cfg = updated(TrainConfig(), target="tiny", max_steps=1, batch_size=4, num_anchors=8, block_size=4,
                  drafter_layers=1, target_layer_ids=TAPS, max_seq_len=256)
    try:
        parts = build(cfg, Dist(), target, log=lambda s: None)
        stage, drafter = parts.targets[0], parts.drafter
        batch = next(b for b in map(parts.source, range(parts.source.per_epoch)) if 2 in b.sample_ids)
        row = batch.sample_ids.index(2)
        hb = stage(batch)
        assert hb.batch.skipped == [row] and parts.bad_samples == [lines_of(root, 2)]
        assert not hb.batch.loss_mask[row].any() and (hb.batch.plan.anchors[row] == -1).all()

        def loss_and_grads(ids, hidden, plan, attn):
            drafter.drafter.zero_grad(set_to_none=True)
            out = drafter.loss(ids, hidden, plan, attn)
            out.loss.backward()
            return out.loss.detach(), {n: p.grad.clone() for n, p in drafter.drafter.named_parameters()
                                       if p.grad is not None}

        masked = loss_and_grads(batch.input_ids, hb.hidden, hb.batch.plan, batch.attention_mask)
        # the batch without the row, padded to its own longest row, its rows' anchors as drawn
        keep = [r for r in range(batch.input_ids.shape[0]) if r != row]
        width = int(batch.attention_mask[keep].sum(1).max())
        ids, attn = batch.input_ids[keep, :width], batch.attention_mask[keep, :width]
        anchors = batch.plan.anchors[keep]
        plan = plan_blocks(ids, batch.loss_mask[keep, :width], 4, anchors.shape[1],
                           anchors=(anchors.clamp(min=0), anchors >= 0))
        assert plan.num_tokens == hb.batch.plan.num_tokens < batch.plan.num_tokens
        full = clean.hidden_states(batch)
        without = loss_and_grads(ids, full[keep, :width], plan, attn)
        torch.testing.assert_close(masked[0], without[0], rtol=1e-5, atol=1e-6)
        assert masked[1].keys() == without[1].keys() and masked[1]
        for name in masked[1]:
            torch.testing.assert_close(masked[1][name], without[1][name], rtol=1e-4, atol=1e-6, msg=name)
        # unmasked, the row's zero states would be trained on: another loss (the check above can fail)
        kept = loss_and_grads(batch.input_ids, hb.hidden, batch.plan, batch.attention_mask)
        assert abs(float(kept[0]) - float(without[0])) > 1e-3
        # the step's model FLOPs are counted again without the row: those of the batch built without it
        alone = Batch(batch.index, ids, attn, batch.loss_mask[keep, :width], plan=plan)
        assert hb.batch.flops == parts.source.flops.of_batch(alone).total < batch.flops
        # the step counts the samples it trained on, and the FLOPs of its batch
        r = drafter.step(hb, 0.0)
        assert r.samples == 3 and r.flops == hb.batch.flops
    finally:
        target.close()
        clean.close()


def test_a_batch_of_bad_samples_only_takes_no_step(cache, tmp_path):
    root = damaged(cache, tmp_path / "bad", {i: "garbled header" for i in range(4)})
    target, _ = cache_target(root)
    cfg = updated(TrainConfig(), target="tiny", max_steps=1, batch_size=4, num_anchors=8, block_size=4,
                  drafter_layers=1, target_layer_ids=TAPS, max_seq_len=256)
    try:
        parts = build(cfg, Dist(), target, log=lambda s: None)
        source = in_order(target, 4)
        hb = parts.targets[0](source(0))
        assert hb.batch.skipped == [0, 1, 2, 3] and len(parts.bad_samples) == 4
        before = {n: p.detach().clone() for n, p in parts.drafter.drafter.named_parameters()}
        r = parts.drafter.step(hb, 0.5)
        assert r.samples == 0 and r.tokens == 0 and r.out.num_tokens == 0
        for n, p in parts.drafter.drafter.named_parameters():
            assert torch.equal(p, before[n]), n  # AdamW's moments did not move them either
        assert parts.drafter.optimizer.state == {} or all(
            int(s.get("step", 0)) == 0 for s in parts.drafter.optimizer.state.values())
        # a batch with something to learn from moves them
        parts.drafter.step(parts.targets[0](source(1)), 0.5)
        assert any(not torch.equal(p, before[n]) for n, p in parts.drafter.drafter.named_parameters())
    finally:
        target.close()


# --- the setting ------------------------------------------------------------------------------------

def test_the_setting_is_a_flag_and_a_toml_key_and_refuses_a_negative_count(tmp_path, capsys):
    assert TrainConfig().health.max_bad_samples == 100
    assert make_config({"health": {"max_bad_samples": 5}}, {}).health.max_bad_samples == 5
    assert make_config({"max_bad_samples": 0}, {}).health.max_bad_samples == 0
    with pytest.raises(ConfigError, match=r"max_bad_samples must be >= 0 \(0: stop at the first bad sample\), got -1"):
        make_config({}, {"max_bad_samples": -1})
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0 and "--max-bad-samples N" in capsys.readouterr().out


# --- real runs ----------------------------------------------------------------------------------------

def _cli_train(hs: Path, run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash", "train", "--target", "tiny", "--hidden-states", str(hs), "--run-dir",
           str(run_dir), "--batch-size", "4", "--num-anchors", "8", "--eval-prompts", "0", "--drafter-layers", "1",
           *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


THREE = {3: "truncated", 11: "header length", 17: "nan"}


def test_a_run_skips_bad_files_finishes_and_reports_them_everywhere(cache, tmp_path, sock_dir):
    """A real run over a cache with three bad files: rc 0, a warning per file in the log, the count at the
    end, in the telemetry's counters and events, and on dflash-top's screen."""
    import asyncio

    from dflash.telemetry.wire.protocol import Event, Snapshot
    from dflash.telemetry.wire.reader import read_frames
    from dflash_tui.app import DFlashTop
    from dflash_tui.sources import MemorySource

    root = damaged(cache, tmp_path / "bad", THREE)
    run = tmp_path / "run"
    # one epoch (6 batches of 4) reads every row
    r = _cli_train(root, run, "--max-steps", "6", "--socket-dir", str(sock_dir), "--log-every", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [x for x in r.stdout.splitlines() if x.startswith("[warning] bad sample skipped")]
    assert len(warned) == 3, r.stdout[-3000:]
    for row, how in THREE.items():
        assert sum(f"{sample_path(root, row)}: " in x and DAMAGE[how][1] in x for x in warned) == 1, (row, warned)
    assert "done: 6 steps, " in r.stdout and ", 3 bad samples skipped (each named above), run dir" in r.stdout
    frames = list(read_frames(run / "telemetry.jsonl"))
    last = [f for f in frames if isinstance(f, Snapshot)][-1]
    assert last.counters["bad_samples"] == 3 and last.counters["samples"] == 6 * 4 - 3
    events = [f for f in frames if isinstance(f, Event) and f.message.startswith("bad sample skipped")]
    assert len(events) == 3 and {e.kind for e in events} == {"warning"}

    async def shown() -> str:
        app = DFlashTop(source=MemorySource(frames, path=run / "telemetry.jsonl"), pyspy_exe="py-spy")
        async with app.run_test(size=(160, 50)) as pilot:
            from test_tui_snapshots import settle

            await settle(pilot)
            return screen_text(app)

    text = asyncio.run(shown())
    assert "3 bad samples skipped" in text, text
    assert "bad sample skipped (3 of at most 100" in " ".join(text.split()), text  # the events panel


def test_a_run_past_the_limit_stops_with_one_line_and_keeps_the_drafter(cache, tmp_path):
    root = damaged(cache, tmp_path / "bad", THREE)
    run = tmp_path / "run"
    r = _cli_train(root, run, "--max-steps", "6", "--max-bad-samples", "2", "--no-telemetry")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("dflash train: "))
    assert line.startswith(f"dflash train: --hidden-states {root}: 3 bad sample files, more than "
                           "--max-bad-samples 2; the latest: "), line
    assert f"fix the file, then dflash train --resume --run-dir {run}" in line
    assert len([x for x in r.stdout.splitlines() if x.startswith("[warning] bad sample skipped")]) == 2


# A writer beside a --follow run: rows and sidecar first, then, once told to go, every file renamed into place
# in row order (as `dflash data cache` writes them), one of them cut short.
WRITER = textwrap.dedent("""
    import os, shutil, sys, time
    from pathlib import Path
    src, dst, bad = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    (dst / "hidden_states").mkdir(parents=True)
    for f in sorted(src.iterdir(), key=lambda f: f.name == "state.json"):
        if f.is_file():
            shutil.copy(f, dst / f.name)
    while not (dst / "go").exists():
        time.sleep(0.01)
    for i in range(len(list((src / "hidden_states").iterdir()))):
        data = (src / "hidden_states" / f"hs_{i}.safetensors").read_bytes()
        tmp = dst / "hidden_states" / f".hs_{i}.tmp"
        tmp.write_bytes(data[:-64] if i == bad else data)
        os.replace(tmp, dst / "hidden_states" / f"hs_{i}.safetensors")
        time.sleep(0.05)
""")


def test_follow_skips_a_bad_file_the_writer_renamed_into_place(cache, tmp_path):
    dst, log = tmp_path / "live", tmp_path / "train.log"
    train_following(WRITER, [str(cache), str(dst), "9"], dst, log,
                    ["--run-dir", str(tmp_path / "run"), "--max-steps", "6", "--batch-size", "4", "--num-anchors",
                     "8", "--eval-prompts", "0", "--drafter-layers", "1", "--no-telemetry"], started="telemetry: off")
    text = log.read_text()
    warned = [x for x in text.splitlines() if x.startswith("[warning] bad sample skipped")]
    assert len(warned) == 1 and f"{sample_path(dst, 9)}: truncated (" in warned[0], text[-3000:]
    assert ", 1 bad sample skipped (each named above), run dir" in text
