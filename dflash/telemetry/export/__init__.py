"""Telemetry for other readers: Prometheus' /metrics (prometheus.py) and the per-rank reports rank 0
gathers into the cluster view (cluster.py)."""
