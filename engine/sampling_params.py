"""Per-request sampling parameters: validated once at the door, immutable afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedinfer.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedinfer.engine.structured.spec import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` means greedy."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's spelling): disabled; stored as 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus top-k alternatives
    skip_special_tokens: bool = True
    use_speculation: bool = True  # per-request opt-out of speculative decoding
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before sampling, sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None  # k >= 0: each prompt token's logprob plus the top-k (vLLM)
    # a grammar the output must match (JSON schema, regex, choice, EBNF/Lark); None: free text
    structured_output: StructuredOutput | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    MAX_N = 16
    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        # Tolerate lists from JSON/protobuf callers; store tuples so the object stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias.items())))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    @property
    def has_penalties(self) -> bool:
        """Any of the three penalties, which read the sequence's token history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_history_free(self) -> bool:
        """Each token is drawn from its own row's logits (temperature, top-k / top-p / min-p, a
        seed and the output position) with nothing that reads the tokens before it: no penalties,
        no min_tokens (its bans depend on the position), and no logit_bias (kept off the device
        chains, which draw from raw logits). What a request must be to join a chained
        step; one with min_tokens still rides a chain that starts after its bans have lifted (the
        runner checks the first step's metadata: chained_sampling.ChainedSampling._chain_may_decide)."""
        return (
            not self.has_penalties
            and self.min_tokens == 0
            and not self.logit_bias
            and self.structured_output is None  # its mask reads the tokens before (structured/masks.py)
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Every token is the raw logits' argmax: greedy and history-free (logits need no fp32
        copy and no processing; a chain with device drafts off rides only these)."""
        return self.temperature == 0.0 and self.is_history_free

    def validate(self) -> None:
        checks = [
            (1 <= self.n <= self.MAX_N, f"n must be in [1, {self.MAX_N}], got {self.n}"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
                f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
                "logit_bias values must be in [-100, 100]",
            ),
            (len(self.logit_bias) <= 1024, "logit_bias holds at most 1024 tokens"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
