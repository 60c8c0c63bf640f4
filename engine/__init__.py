"""paged-infer engine: model execution, continuous batching, serving."""

__version__ = "0.1.0"
