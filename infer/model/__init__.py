"""The model: a lean forward over a checkpoint's weights (layer math, attention, KV caches, executors, skip plans)."""
