"""Getting telemetry out of the trainer: the publisher thread (server.py) and its clients (peers.py),
the recording (recorder.py), the machine's samples (system.py) and the trainer's own threads and stacks
(introspection.py)."""
