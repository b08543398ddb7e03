"""Run speculators' own trainer (`speculators train`) on a machine without a GPU: the sampled view's
second real trainer (scripts/record_stacks.py). Run it with the Python of an environment where
`pip install speculators` installed; the arguments are speculators' own.

speculators 0.9 places the drafter and every batch on the accelerator of its local rank and synchronises
that accelerator on logged steps; here both go to the CPU instead. Nothing else of its trainer changes:
the stacks it leaves are its own. Its DataLoader starts workers with `spawn`, which re-imports this file,
hence the main guard.
"""

import sys

if __name__ == "__main__":
    import torch

    # one intra-op thread: the recording is of where the trainer's time goes, not of OpenMP's threads
    torch.set_num_threads(1)
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: torch.device("cpu")
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    main(TrainConfig.resolve(sys.argv[1:]))
