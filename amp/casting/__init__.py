"""O1 and regions: the wrappers and casts that run each op in its table's dtype, the weight-cast
cache, the patch set and torch's autocast surface answered from amp's state, autocast regions,
fp32_modules, registration, and FP8 linears (float8.py, float8_wrapper.py)."""
