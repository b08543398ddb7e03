"""Evaluation runs with the threads the workers use: the trainer's final evaluation (on the main thread,
which the pipeline's per-worker setting never reached) and `dflash eval` of a run, each saying so."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _cfg, _write_data

from dflash.cli import main
from dflash.train.reporting.evaluation import threads_text, torch_threads
from dflash.train.trainer import Trainer


@pytest.fixture
def two_threads():
    """The process's default as on a 2-core machine, whatever the test session set: what the final
    evaluation inherited before it set its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalthreads")
    return make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer()), _write_data(root / "data.jsonl")


def test_torch_threads_sets_and_restores(two_threads) -> None:
    with torch_threads(1) as n:
        assert n == torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with torch_threads(None) as n:  # nothing chosen: torch's as they are
        assert n == 2
    assert threads_text(1, "as each worker") == "1 torch thread (as each worker)"
    assert threads_text(2, None) == "2 torch threads (torch's default)"


def test_the_final_evaluation_uses_the_workers_threads(setup, tmp_path, two_threads) -> None:
    target, data = setup
    seen: list[tuple[str, int]] = []

    class Watched(Trainer):
        def setup(self) -> None:
            super().setup()
            # what each drafter forward ran with, and on which thread
            self.parts.drafter.drafter.register_forward_hook(
                lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))

    lines: list[str] = []
    t = Watched(_cfg(target, data, tmp_path / "run", max_steps=1, eval_prompts=1, eval_max_new_tokens=8,
                     threads_per_worker=1), log=lines.append)
    assert t.run() == 0
    final = [n for name, n in seen if name == threading.main_thread().name]
    assert final and set(final) == {1}, seen  # the main thread's evaluation, at the workers' 1 thread
    assert torch.get_num_threads() == 2, "the main thread's own count is back after the evaluation"
    phase = next(x for x in lines if "[phase] final evaluation" in x)
    assert phase.endswith("1 torch thread (as each worker)"), phase


def test_dflash_eval_of_a_run_uses_its_threads_and_says_so(setup, tmp_path, capsys, two_threads) -> None:
    target, data = setup
    run = tmp_path / "run"
    assert Trainer(_cfg(target, data, run, max_steps=1, threads_per_worker=1), log=lambda s: None).run() == 0
    args = ["eval", "--drafter", str(run), "--data", str(data), "--max-new-tokens", "6", "--num-prompts", "1",
            "--json", "--device", "cpu"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["lossless"] is True
    assert "dflash eval: 1 torch thread (as each worker of its run; --threads to change)\n" in err, err
    assert main([*args, "--threads", "2"]) == 0
    assert "dflash eval: 2 torch threads (--threads)\n" in capsys.readouterr().err
    assert torch.get_num_threads() == 2
