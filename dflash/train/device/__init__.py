"""The drafter's device side: each thread bound to its device (binding.py), a step sized to the
device's memory and the allocator watched (memory.py), metrics summed on the device and read once per
interval (metrics.py)."""
