"""A run's health: the non-finite guard that skips and counts bad steps (nonfinite.py) and the fault
drills that show the guard, the watchdog and the anomaly detector working on a real run (faults.py)."""
