"""Version of the operator (kept with the engine's)."""

OPERATOR_VERSION = "0.1.0"
