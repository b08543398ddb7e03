"""The batch order: length buckets, the data position in samples (resume on another world size or batch
size), rows held out of training for evaluation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from test_model_helpers import WORDS, make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.data import DataError, Sample
from dflash.data.held_out import HELD_OUT_FILE, choose_rows, prompt_of_sample, row_hashes
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.vocab import Gauge
from dflash.train.config.schema import make_config
from dflash.train.run.build import data_position
from dflash.train.run.stages import BatchSource, DataPosition
from dflash.train.trainer import Trainer


def skewed(n: int, seed: int = 0) -> list[Sample]:
    """Rows of lognormal lengths (most short, a few long), each row's tokens its own index."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.0, 0.9, n).astype(int), 4, 2000)
    return [Sample([i] * int(k), [0] + [1] * (int(k) - 1)) for i, k in enumerate(lengths)]


def padding(source: BatchSource, batches: range) -> float:
    built = [source(i) for i in batches]
    slots = sum(b.input_ids.numel() for b in built)
    return 1 - sum(b.num_tokens for b in built) / slots


def epoch_ids(sources: list[BatchSource], batches: range) -> list[int]:
    return [j for i in batches for s in sources for j in s.sample_ids(i)]


# --- the order -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket", [False, True])
def test_an_epoch_takes_every_sample_once_and_ranks_never_share_one(bucket):
    samples = skewed(203)
    ranks = [BatchSource(samples, 4, seed=3, pad_id=0, rank=r, world_size=3, bucket=bucket) for r in range(3)]
    per = ranks[0].per_epoch
    assert per == 203 // 12
    for epoch in range(2):
        ids = epoch_ids(ranks, range(epoch * per, (epoch + 1) * per))
        assert len(ids) == len(set(ids)) == per * 12  # the 11 left over wait for a later epoch
    first, second = (set(epoch_ids(ranks, range(e * per, (e + 1) * per))) for e in range(2))
    assert first != second  # each epoch its own order (its own leftovers)


def test_off_is_the_plain_shuffle_of_every_earlier_release():
    samples = skewed(40)
    src = BatchSource(samples, 4, seed=3, pad_id=0, rank=1, world_size=2, bucket=False)
    perm = list(range(40))
    random.Random(3 * 1_000_003 + 1).shuffle(perm)  # epoch 1's, as BatchSource always drew it
    assert src.sample_ids(src.per_epoch + 2) == perm[(2 * 2 + 1) * 4:(2 * 2 + 2) * 4]


def test_buckets_cut_the_padding_and_give_a_steps_ranks_similar_lengths():
    samples = skewed(4096)
    lengths = np.array([len(s.input_ids) for s in samples])
    shares, spread = {}, {}
    for bucket in (False, True):
        ranks = [BatchSource(samples, 8, seed=1, pad_id=0, rank=r, world_size=2, bucket=bucket) for r in range(2)]
        shares[bucket] = padding(ranks[0], range(ranks[0].per_epoch))
        # the longest row of each rank in a step: the step waits for the slowest rank
        widths = np.array([[lengths[r.sample_ids(i)].max() for r in ranks] for i in range(ranks[0].per_epoch)])
        spread[bucket] = float(np.median(widths.max(1) / widths.min(1)))
    assert shares[False] > 0.5 and shares[True] < 0.1, shares
    assert spread[True] < 1.1 < spread[False], spread


def test_lengths_come_from_the_sequence_when_it_keeps_them():
    class Store(list):  # a sequence of samples that knows its rows' lengths (as a token store does)
        pass

    samples = Store(skewed(64))
    samples.lengths = np.array([len(s.input_ids) for s in samples])[::-1].copy()  # not the rows' own
    src = BatchSource(samples, 8, seed=0, pad_id=0, bucket=True)
    ids = src.sample_ids(0)
    # sorted by the lengths the sequence gave, not the ones counted from its rows
    assert np.ptp(samples.lengths[ids]) <= np.ptp(np.array([len(samples[i].input_ids) for i in ids]))
    src.sample_ids(1)
    assert src._lengths is not None and (src._lengths == samples.lengths).all()


def test_rows_held_out_never_train_and_batches_name_rows_of_the_whole_set():
    samples = skewed(50)
    held = [3, 17, 30]
    train = [i for i in range(50) if i not in held]
    for bucket in (False, True):
        src = BatchSource(samples, 4, seed=2, pad_id=0, bucket=bucket, train=train)
        assert src.per_epoch == 47 // 4
        batches = [src(i) for i in range(3 * src.per_epoch)]
        ids = [j for b in batches for j in b.sample_ids]
        assert not set(ids) & set(held)
        for b in batches:  # the tokens are the named rows' own (each row's tokens are its index)
            assert b.input_ids[:, 0].tolist() == b.sample_ids


# --- the data position ------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (2, 3)])
def test_a_resume_on_another_world_size_repeats_and_skips_no_sample(bucket, before, after):
    """Rank sets of two world sizes, the second resumed at the first's position after 5 steps: the samples
    they consume partition the epoch (up to the leftovers that fill no step of the second)."""
    samples = skewed(150)
    old = [BatchSource(samples, 4, seed=5, pad_id=0, rank=r, world_size=before, bucket=bucket)
           for r in range(before)]
    done = epoch_ids(old, range(5))
    at = DataPosition.from_dict(old[0].position(5).to_dict())  # as a checkpoint records and reads it
    assert (at.epoch, at.consumed) == (0, 5 * 4 * before)
    new = [BatchSource(samples, 4, seed=5, pad_id=0, rank=r, world_size=after, bucket=bucket) for r in range(after)]
    for s in new:
        s.resume_at(5, at)
    left = (150 - at.consumed) // (4 * after)
    rest = epoch_ids(new, range(5, 5 + left))
    assert len(done) + len(rest) == len(set(done) | set(rest))  # none twice
    assert 150 - len(set(done) | set(rest)) < 4 * after  # none skipped but a last part-step
    assert new[0].position(5 + left) == DataPosition(1, 0, 4 * after, bucket, 150)  # then the next epoch
    nxt = epoch_ids(new, range(5 + left, 5 + left + new[0].per_epoch))
    assert len(nxt) == len(set(nxt)) == new[0].per_epoch * 4 * after


def test_a_checkpoint_from_before_the_position_was_recorded_resumes_where_it_stopped():
    """Such a checkpoint holds the next batch index only; its world size is the count of its ranks' RNG
    states and its batch size its config's."""
    samples = skewed(60)
    two = [BatchSource(samples, 4, seed=1, pad_id=0, rank=r, world_size=2) for r in range(2)]
    ckpt = {"state": {"next_batch": 9}, "rng_per_rank": [{}, {}], "config": {"data": {"batch_size": 4}}}
    one = BatchSource(samples, 3, seed=1, pad_id=0)
    at = data_position(ckpt, one)
    assert at == DataPosition(1, 8 * 2, 8, False, 60)  # 7 steps an epoch: batch 9 is epoch 1's third
    one.resume_at(9, at)
    assert one.sample_ids(9) + one.sample_ids(10) == two[0].sample_ids(9)[:4] + two[1].sample_ids(9)[:2]


def test_a_position_for_other_data_is_refused():
    src = BatchSource(skewed(30), 4, seed=0, pad_id=0)
    with pytest.raises(ValueError, match="counts 31 training samples, the data has 30"):
        src.resume_at(3, DataPosition(0, 8, 4, True, 31))
    with pytest.raises(ValueError, match="does not read"):
        DataPosition.from_dict({"epoch": 1})


# --- held-out rows ---------------------------------------------------------------------------------


def test_held_out_rows_have_prompts_and_do_not_depend_on_rows_added_later():
    rows = [Sample([1, 2, 3, 4], [1, 1, 1, 1]) if i % 3 == 0 else Sample([5, 6, i, 7], [0, 0, 1, 1])
            for i in range(300)]
    chosen = choose_rows(rows, seed=4, count=8)
    assert len(chosen) == 8 and all(i % 3 for i in chosen)  # text rows (all supervised) have no prompt
    assert prompt_of_sample(rows[chosen[0]]) == [5, 6] and prompt_of_sample(rows[0]) is None
    # more rows: an earlier row held out now was held out before (the new ones may take some places)
    grown = choose_rows(rows + rows[:100], seed=4, count=8)
    assert {i for i in grown if i < 300} <= set(chosen) and any(i >= 300 for i in grown)
    assert choose_rows(rows, seed=5, count=8) != chosen
    assert len(set(row_hashes(10_000, 0).tolist())) == 10_000


def _write_data(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            response = " ".join(rng.choice(WORDS) for _ in range(rng.choice([8, 12, 40, 90])))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return path


class Recorded(Trainer):
    """A trainer whose batch source notes the rows of every batch it builds (in sync mode: the batches
    trained on), and that stops itself after ``stop_at`` steps."""

    def __init__(self, *a, stop_at: int | None = None, **kw):
        super().__init__(*a, **kw)
        self.stop_at, self.trained = stop_at, []

    def setup(self):
        super().setup()
        source, trained = self.parts.source, self.trained

        class Noting(type(source)):
            def __call__(self, index):
                batch = super().__call__(index)
                trained.append(batch.sample_ids)
                return batch

        source.__class__ = Noting

    def on_step(self, r):
        if self.stop_at is not None and self.state.step + 1 == self.stop_at:
            self.stop_requested.set()
        return super().on_step(r)


def test_a_run_holds_rows_out_evaluates_on_them_and_resumes_with_another_batch_size(tmp_path):
    """End to end on a real tiny target: rows held out of training (recorded in the run dir), evaluated on
    and said so; the padding share published; stopped after 2 steps of 4 samples and resumed with steps of
    2, the run trains every other sample of the epoch exactly once."""
    target = make_target_dir(tmp_path / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(tmp_path / "data.jsonl", 24)
    run_dir = tmp_path / "run"

    def cfg(**kw):
        base = dict(target=str(target), data=str(data), run_dir=str(run_dir), batch_size=4, num_anchors=4,
                    block_size=4, max_steps=9, log_every=1e9, telemetry=True, socket_dir=str(tmp_path / "s"),
                    telemetry_interval=0.05, gil_probe=False, eval_prompts=2, eval_max_new_tokens=4,
                    checkpoint_every=1e9, drafter_layers=1, pipeline=False, threads_per_worker=1)
        return make_config({}, {**base, **kw})

    lines: list[str] = []
    first = Recorded(cfg(), stop_at=2, log=lines.append)
    assert first.run() == 0 and first.state.step == 2
    held = json.loads((run_dir / HELD_OUT_FILE).read_text())["rows"]
    assert len(held) == 2 and first.parts.evals.held_out == held
    assert "evaluation on 2 held-out rows of --data" in "\n".join(lines)
    gauges = [f.gauges[Gauge.PADDING_SHARE] for f in read_frames(run_dir / "telemetry.jsonl")
              if getattr(f, "gauges", None) and Gauge.PADDING_SHARE in f.gauges]
    assert gauges and 0 < gauges[-1] < 1

    lines.clear()
    second = Recorded(cfg(batch_size=2), resume=True, log=lines.append)
    assert second.run() == 0 and second.state.step == 9
    out = "\n".join(lines)
    assert "resumed from step 2 (batch 2: epoch 0, sample 8 of 22" in out, out
    assert second.parts.evals.held_out == held
    trained = [j for ids in first.trained + second.trained for j in ids]
    assert sorted(trained) == sorted(set(range(24)) - set(held))  # 2 x 4 + 7 x 2: the 22 once each
    final = json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])
    assert final["prompts"] == "2 held-out rows of --data " + str(data)
    assert f"final tau {final['tau']:.2f} on 2 held-out rows of --data" in out
    assert "step 9: tau" in out and "on 2 held-out rows" in out


def test_what_evaluations_read_and_what_they_are_called(tmp_path):
    """--eval-data's prompts (nothing held out), held-out rows of --data (recorded rows kept on a resume),
    a run from before held-out rows (trained on, said so), and a bad --eval-data file in one line."""
    from types import SimpleNamespace

    from dflash.data.held_out import save_record
    from dflash.train.run.build import TrainError, eval_set

    tok = make_tokenizer()
    data = _write_data(tmp_path / "data.jsonl", 30)
    samples = [Sample([1, 2, 3, i], [0, 0, 1, 1]) for i in range(30)]
    target, verifier = SimpleNamespace(tokenizer=tok), object()
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def chosen(resuming=False, **kw):
        cfg = make_config({}, {"data": str(data), "run_dir": str(run_dir), "max_steps": 1, "eval_prompts": 3, **kw})
        return eval_set(cfg, samples, data, target, verifier, resuming=resuming)

    fresh = chosen()
    assert fresh.what == f"3 held-out rows of --data {data}" and len(fresh.held_out) == 3
    assert fresh.prompts == [[1, 2]] * 3
    assert chosen(eval_prompts=0).held_out == []  # nothing evaluated: nothing held out

    other = _write_data(tmp_path / "other.jsonl", 5)
    given = chosen(eval_data=str(other))
    assert given.what == f"3 prompts of --eval-data {other}" and given.held_out == [] and len(given.prompts) == 3

    old = chosen(resuming=True)  # no record: the run began before rows were held out
    assert old.held_out == [] and "trained on" in old.what and old.what.startswith("the first 3 rows of --data")
    save_record(run_dir, [1, 7], str(data), 0)
    assert chosen(resuming=True).held_out == [1, 7]  # the record, whatever the count asks now
    assert chosen(resuming=True, eval_data=str(other)).held_out == [1, 7]  # still out of training

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt here"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: a 'text' row has no prompt"):  # build: one line
        chosen(eval_data=str(bad))
    few = eval_set(make_config({}, {"data": str(data), "run_dir": str(tmp_path / "r3"), "max_steps": 1}),
                   samples[:9], data, target, verifier, resuming=False)  # a tenth of 9 rows: none to spare
    assert few.prompts == [] and few.held_out == [] and "too few to hold any out" in few.what
    text_only = [Sample([1, 2, 3], [1, 1, 1])] * 40
    cfg = make_config({}, {"data": str(data), "run_dir": str(tmp_path / "r2"), "max_steps": 1})
    with pytest.raises(TrainError, match="no row has a prompt"):
        eval_set(cfg, text_only, data, target, verifier, resuming=False)
