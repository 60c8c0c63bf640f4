"""Pure desired-state rendering: an `InferenceEngine` spec in, Kubernetes objects (dicts) out."""
