"""`dflash eval` end to end on a tiny random target with a tokenizer, and its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from test_model_helpers import WORDS, make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.cli import main
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.export import checkpoint_dict, export_drafter
from dflash.model.target import load_target


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
