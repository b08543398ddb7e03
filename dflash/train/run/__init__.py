"""A run: build() from a config and a target, the stages, the pipeline that drives them."""
