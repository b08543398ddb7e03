"""Judging what the timings say: the bottleneck verdict's evidence (evidence.py) and the verdict the
trainer publishes (published.py: the last seconds judged, held, the whole run at the end), stalled
workers (watchdog.py), sustained slowdowns (anomalies.py) and the GIL probe (gil.py)."""
