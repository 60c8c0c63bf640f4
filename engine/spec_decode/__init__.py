"""Speculative decoding: proposers (n-gram, draft model), the controller the engine calls."""
