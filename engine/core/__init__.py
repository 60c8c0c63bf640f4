"""CPU-only engine bookkeeping (scheduling, KV block management). Never imports torch."""
