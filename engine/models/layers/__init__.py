"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP, paged attention."""
