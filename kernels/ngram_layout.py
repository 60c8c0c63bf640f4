"""Columns of the packed [B, PACKED_FIXED + (K_step + 1) + K] int64 result of one chained n-gram
step (ngram_propose.launch_packed; engine.spec_decode.device_chain): one host copy per step, and
the next step's inputs read from it on the device."""

COL_NUM_SLOTS = 0  # draft rows the step had per sequence (what the host planned)
COL_NUM_DRAFTS = 1  # drafts verified (a chained step's filler, no match: 0)
COL_NUM_EMITTED = 2  # accepted drafts + 1
COL_HAS_MATCH = 3  # 1: the next drafts come from a match (0: filler)
PACKED_FIXED = 4  # then the emitted tokens [K_step + 1] (0-padded), then the next drafts [K]
