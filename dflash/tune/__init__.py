"""`dflash tune`: short measured trials of a run's throughput settings, each next one chosen by the last
one's bottleneck verdict (docs/tune.md).

knobs.py holds what the tuner may change and what it never changes, and the chooser; measure.py reads a
trial's own telemetry recording into tokens/s, its spread and the verdict; table.py keeps the table of
trials (resumable) and writes the best settings as TOML; trial.py runs one trial as a `dflash train`
subprocess and cleans up after it.
"""
