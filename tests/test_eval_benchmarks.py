"""`dflash eval --bench`: the shipped few-row fixtures (real public rows, each in its data set's own
schema) prompted as the reference harness prompts them, the table, the bars, --json and --compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.eval.benchmarks import (
    BENCHMARKS,
    MATH_SUFFIX,
    BenchError,
    bar_chart,
    bench_rows,
    paper_figures,
    parse_bench,
    run_benchmark,
)
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.write_export import export_drafter
from dflash.targets import load_target

FIXTURES = Path(__file__).parent / "fixtures" / "bench"


@pytest.fixture(scope="module")
def tiny():
    target = load_target("tiny", device="cpu", num_draft_layers=1)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=target.layer_ids,
                                   mask_token_id=target.default_mask_token_id())
    return target, DFlashDrafter(cfg)


def test_every_benchmark_has_its_fixture_in_its_own_schema():
    assert parse_bench("all") == list(BENCHMARKS) and len(BENCHMARKS) == 10
    for name in BENCHMARKS:
        rows = bench_rows(name, FIXTURES, 5)
        assert len(rows) >= 2 and all(t for r in rows for t in r), name


def test_prompts_are_normalised_as_the_reference_harness():
    assert bench_rows("gsm8k", FIXTURES, 1)[0][0].startswith("Janet’s ducks lay 16 eggs per day.")
    assert bench_rows("gsm8k", FIXTURES, 1)[0][0].endswith(
        "\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert bench_rows("math500", FIXTURES, 1)[0][0].endswith(MATH_SUFFIX)
    he = bench_rows("humaneval", FIXTURES, 1)[0][0]
    assert he.startswith("Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\nfrom typing import List") and he.endswith("\"\"\"\n\n```")
    assert bench_rows("mbpp", FIXTURES, 1)[0] == ["Write a function to find the shared elements from the given two "
                                                   "lists."]
    mt = bench_rows("mt-bench", FIXTURES, 1)[0]
    assert len(mt) == 2 and mt[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert bench_rows("alpaca", FIXTURES, 2)[1] == ["Identify the odd one out.\n\nTwitter, Instagram, Telegram"]
    assert "```python\nclass Solution:" in bench_rows("livecodebench", FIXTURES, 2)[1][0]


def test_bad_benchmarks_are_refused_in_one_line(tmp_path):
    with pytest.raises(BenchError, match="unknown benchmark 'gsm9k'"):
        parse_bench("gsm8k,gsm9k")
    with pytest.raises(BenchError, match="gsm8k.jsonl: No such file"):
        bench_rows("gsm8k", tmp_path, 2)
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"problem": "a maths row in the wrong schema"}) + "\n")
    with pytest.raises(BenchError, match="gsm8k row 1: no 'question' \\(the openai/gsm8k schema has it\\)"):
        bench_rows("gsm8k", tmp_path, 2)
    (tmp_path / "mbpp.jsonl").write_text("{not json\n")
    with pytest.raises(BenchError, match="mbpp.jsonl:1: not JSON"):
        bench_rows("mbpp", tmp_path, 2)


def test_mt_bench_is_decoded_turn_by_turn_after_the_targets_reply(tiny, monkeypatch):
    target, drafter = tiny
    from dflash.data import formats

    seen = []
    real = formats.chat_prompt
    monkeypatch.setattr(formats, "chat_prompt",
                        lambda m, *a, **k: seen.append([dict(x) for x in m]) or real(m, *a, **k))
    r = run_benchmark(drafter, target, bench_rows("mt-bench", FIXTURES, 1), 6)
    assert r.num_prompts == 2 and r.lossless is True
    assert [x["role"] for x in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][1]["content"] and seen[1][2]["content"].startswith("Rewrite your previous response")


def test_bars_and_paper_figures():
    assert bar_chart([1.0, 0.5, 0.0], width=10) == ["   1 ########## " + " 1.00", "   2 #####      " + " 0.50",
                                                    "   3            " + " 0.00"]
    assert paper_figures("/models/Qwen3-8B/", 0.0)["gsm8k"] == (5.20, 6.55)
    assert paper_figures("Qwen/Qwen3-8B", 1.0) == {"gsm8k": (4.78, 6.04)}
    assert paper_figures("tiny", 0.0) == {} and paper_figures("Qwen3-4B", 0.0) == {}


def test_eval_bench_command_table_json_and_compare(tiny, tmp_path, capsys):
    target, drafter = tiny
    export_drafter(drafter, tmp_path / "d")
    base = ["eval", "--drafter", str(tmp_path / "d"), "--target", "tiny", "--bench", "gsm8k,mt-bench",
            "--bench-dir", str(FIXTURES), "--num-prompts", "1", "--max-new-tokens", "6", "--device", "cpu"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["benchmark", "prompts", "tau", "speedup", "lossless"]
    assert out.splitlines()[1].split()[:2] == ["gsm8k", "1"] and out.splitlines()[2].split()[:2] == ["mt-bench", "2"]
    assert "gsm8k: acceptance by block position" in out
    assert len([x for x in out.splitlines() if x.startswith("   ")]) == 6  # 3 bars per benchmark
    assert main(base + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["benchmarks"]) == {"gsm8k", "mt-bench"} and r["paper"] == {}
    g = r["benchmarks"]["gsm8k"]
    assert g["lossless"] is True and len(g["per_position_acceptance"]) == 3 and g["tau"] >= 1
    (tmp_path / "a.json").write_text(json.dumps(r))
    r["benchmarks"]["gsm8k"]["tau"] += 0.5
    (tmp_path / "b.json").write_text(json.dumps(r))
    assert main(["eval", "--drafter", "unused", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["benchmark", "tau", "A", "tau"] and lines[1].split()[3] == "+0.50"
    assert main(base[:-2] + ["--bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
