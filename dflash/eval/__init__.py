"""Evaluation: the real draft-then-verify loop (speculative.py) and the acceptance numbers it yields."""

from dflash.eval.speculative import EvalResult, evaluate, greedy_generate, speculative_generate

__all__ = ["EvalResult", "evaluate", "greedy_generate", "speculative_generate"]
