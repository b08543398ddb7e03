"""A run's parts: build() from a config and a target, the stages, the pipeline that drives them,
devices, the non-finite guard, fault drills, device-side metrics, memory sizing."""
