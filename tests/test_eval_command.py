"""`dflash eval` end to end on a tiny random target with a tokenizer, and its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from test_eval_speculative import runner_up, tie_last
from test_model_helpers import WORDS, make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.cli import main
from dflash.data import load_prompts
from dflash.eval import speculative
from dflash.eval.speculative import greedy_generate
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.export import checkpoint_dict
from dflash.model.write_export import export_drafter
from dflash.targets import load_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcmd")
    tok = make_tokenizer()
    target_dir = make_target_dir(root / "target", "qwen3", layers=4, vocab=len(tok) + 8, tokenizer=tok)
    target = load_target(target_dir, num_draft_layers=2)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=target.layer_ids,
                                   mask_token_id=target.default_mask_token_id())
    drafter = DFlashDrafter(cfg)
    torch.save(checkpoint_dict(drafter), root / "ckpt.pt")
    export_drafter(drafter, root / "export")
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": " ".join(WORDS[i: i + 5]), "response": "x"})
                              for i in range(4)) + "\n")
    return root, target_dir, data


@pytest.mark.parametrize("drafter", ["ckpt.pt", "export"])
def test_eval_json_report(setup, capsys, drafter):
    root, target_dir, data = setup
    rc = main(["eval", "--drafter", str(root / drafter), "--target", str(target_dir), "--data", str(data),
               "--max-new-tokens", "12", "--num-prompts", "3", "--json", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads(out)
    assert r["lossless"] is True and r["num_prompts"] == 3 and r["block_size"] == 4
    assert r["tau"] >= 1.0 and r["rounds"] > 0 and len(r["per_position_acceptance"]) == 3
    assert sum(r["acceptance_histogram"]) == r["rounds"]
    assert {"target_forwards", "baseline_forwards", "forwards_saved", "tokens_generated"} <= set(r)
    # the wall-time speedup over plain greedy decoding, and what a round costs in its steps
    assert r["speedup"] == pytest.approx(r["greedy_seconds"] / r["speculative_seconds"])
    step = r["greedy_seconds"] / r["baseline_forwards"]
    assert r["round_cost"] == pytest.approx(r["speculative_seconds"] / r["rounds"] / step)


def test_the_speedup_is_said_plainly_and_a_slow_down_says_why(setup, capsys):
    from types import SimpleNamespace

    from dflash.commands.eval import speed_text

    slow = SimpleNamespace(speedup=13.9 / 26.9, speculative_seconds=26.9, greedy_seconds=13.9,
                           block_size=16, round_cost=2.8, tau=1.46)
    text = speed_text(slow)
    assert text.startswith("SLOWER than plain decoding: 0.52x in wall time (26.9 s speculative vs 13.9 s plain")
    assert "takes as long as 2.8 plain decoding steps but yields tau 1.46 tokens" in text, text
    assert speed_text(SimpleNamespace(**{**vars(slow), "speedup": 2.5})).startswith("speedup 2.50x in wall time")
    # end to end: the text report has the line; without the plain decode it says it was not measured
    root, target_dir, data = setup
    args = ["eval", "--drafter", str(root / "export"), "--target", str(target_dir), "--data", str(data),
            "--max-new-tokens", "6", "--num-prompts", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "SLOWER than plain decoding" in out or "speedup" in out and "x in wall time" in out, out
    assert main([*args, "--no-lossless-check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speedup"] is None
    assert main([*args, "--no-lossless-check"]) == 0
    assert "speedup: not measured" in capsys.readouterr().out


def test_eval_text_report_and_errors(setup, capsys):
    root, target_dir, data = setup
    args = ["--target", str(target_dir), "--data", str(data), "--max-new-tokens", "6", "--num-prompts", "1"]
    assert main(["eval", "--drafter", str(root / "export"), *args]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "lossless (== target greedy): yes" in out
    for bad, needle in [(["--drafter", str(root / "nope"), *args], "no such file"),
                        (["--drafter", str(root / "export"), "--target", str(root / "nope"), "--data", str(data)],
                         "no such file"),
                        (["--drafter", str(root / "export"), *args, "--block-size", "9"], "--block-size")]:
        assert main(["eval", *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dflash eval: error:") and needle in err and err.count("\n") == 1, err


def test_exit_status_is_1_only_for_a_real_divergence(setup, capsys, monkeypatch, tmp_path):
    """A near-tie that verification broke the other way is reported and exits 0; a broken verification
    exits 1. Real target on disk; the fault is injected at the verification's greedy choice."""
    root, target_dir, data = setup
    args = ["--drafter", str(root / "export"), "--data", str(data), "--max-new-tokens", "10",
            "--num-prompts", "2", "--device", "cpu"]
    monkeypatch.setattr(speculative, "_pick", runner_up)
    assert main(["eval", "--target", str(target_dir), *args]) == 1
    err = capsys.readouterr().err
    assert "DIVERGED at token 0" in err and "NOT LOSSLESS on prompts [0, 1]" in err

    # Tie the LM-head row of the first token greedy decoding picks with the last (unused) row.
    target = load_target(target_dir, num_draft_layers=2)
    first = greedy_generate(target, load_prompts(str(data), target.tokenizer, 1)[0], 1)[0]
    model, tok = target.model, target.tokenizer
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[-1] = head[first]
    model.save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    monkeypatch.setattr(speculative, "_pick", tie_last)
    capsys.readouterr()
    assert main(["eval", "--target", str(tmp_path / "tied"), *args]) == 0
    captured = capsys.readouterr()
    assert "near-tie (rounding, not a loss)" in captured.err and "NOT LOSSLESS" not in captured.err
    assert "left greedy only at a near-tie" in captured.out


def test_a_run_is_evaluated_against_the_target_it_trained_against(setup, capsys, tmp_path):
    """Without --target, `dflash eval` reads the run's config.json (a run directory, or the one above a
    checkpoint file) instead of assuming the built-in target, whose shapes would not fit."""
    from dflash.train.config import TrainConfig
    from dflash.train.config.schema import config_beside, updated

    root, target_dir, data = setup
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001.pt").write_bytes((root / "ckpt.pt").read_bytes())
    updated(TrainConfig(), target=str(target_dir), run_dir=str(run)).save(run / "config.json")
    args = ["--data", str(data), "--max-new-tokens", "6", "--num-prompts", "1", "--json", "--device", "cpu"]
    for drafter in (run, run / "checkpoints" / "step-00000001.pt"):
        assert main(["eval", "--drafter", str(drafter), *args]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["lossless"] is True
        assert f"target {target_dir} (the one its run trained against" in err
    # a run that trained from hidden states alone names the model that evaluates it (--eval-target)
    updated(TrainConfig(), target="/no/such/cache", eval_target=str(target_dir), run_dir=str(run)).save(
        run / "config.json")
    assert main(["eval", "--drafter", str(run), *args]) == 0
    assert f"target {target_dir} (the one its run evaluated with" in capsys.readouterr().err
    # an export's config.json is the drafter's own; a loose checkpoint file has no run around it
    assert config_beside(root / "export") is None and config_beside(root / "ckpt.pt") is None
    # a run whose config.json does not read is one clear line, not a silent guess
    (run / "config.json").write_text('{"model_type": "qwen3"}')
    assert main(["eval", "--drafter", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert "unknown setting 'model_type'" in err and "give --target" in err and len(err.strip().splitlines()) == 1
    # ... and with --target given, the run's config only lends threads: it is passed over with a note
    assert main(["eval", "--drafter", str(run), "--target", str(target_dir), *args]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["lossless"] is True and "the drafter's run config is not read" in err
