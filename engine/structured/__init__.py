"""Structured outputs: a request's grammar (spec.py, no torch), its compilation against the
tokenizer (compiler.py, xgrammar) and the per-step token masks the sampler applies (masks.py)."""
