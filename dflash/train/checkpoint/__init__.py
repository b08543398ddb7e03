"""Checkpointing during a run: which checkpoint to resume, what one holds, writing it without
stalling the drafter, and the RNG state it carries (the files themselves: dflash/checkpoint_files.py)."""
