"""The wire: all that dflash-top shares with the trainer (frames, their reader, socket naming and trust,
the category table, the vocabulary, the process sampler). Torch-free; nothing here imports the rest of dflash."""
