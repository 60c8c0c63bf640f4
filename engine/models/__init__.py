"""Model runtime: Llama-family decoders, weight loaders (safetensors, GGUF), model URI resolution."""
