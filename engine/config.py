"""Frozen configuration dataclasses: model, cache, scheduler, speculative, device, server.

Environment variables are read in one place only: `ServerConfig.from_env_defaults`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_MODEL_URI = "builtin://smollm2-135m"


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style rope scaling ("llama3"), or linear; None on the ModelConfig means none."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # rope_type "freq_factors": inv_freq[i] /= freq_factors[i] (llama.cpp's rope_freqs tensor).
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a Llama-family decoder (from config.json or GGUF metadata)."""

    architecture: str  # "llama", "mistral", "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.90  # fraction of device memory the engine may use in all
    num_blocks: int | None = None  # explicit override of the memory-derived count
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024  # KV budget when running on the CPU
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024  # beyond: RESOURCE_EXHAUSTED / HTTP 429
    aging_seconds: float = 30.0  # a waiting request gains one priority level per this much wait
    watermark_blocks_fraction: float = 0.01  # kept free at admission so running decodes can grow
    # Plan and launch step N+1 while step N runs (core/lookahead.py). None: on for CUDA devices,
    # off on the CPU (whose kernels run on the host thread, so there is nothing to overlap).
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # None, "ngram" or "draft"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    # n-gram: "folded" also matches tokens up to a leading space and letter case where the ids match
    # nowhere (spec_decode/ngram_keys.py: "The" finds " the"; drafts stay the exact tokens after the
    # match), "exact" matches ids only
    ngram_match: str = "folded"
    max_batch_size: int = 32  # above this many running sequences speculation is skipped for the step
    min_acceptance_rate: float = 0.2  # per sequence, below this its speculation pauses
    # batches of greedy or sampled requests without penalties, min_tokens or logprobs: accept on
    # the device (n-gram: drafts matched against each row's draw; draft: rejection sampling) and
    # plan steps ahead (async scheduling), drafting there by prompt lookup (n-gram) or with the
    # draft model (draft: a chain starts from a step
    # whose drafts stayed on the device, see device_drafts, and goes on from a step admitting a
    # prompt), spec_decode/device_chain.py; off:
    # every speculative step is synchronous
    device_chain: bool = True
    # n-gram: chained verification steps launched back to back per host pass (each feeds the next
    # on the device; the host plans and applies them as one step): the host's per-step work is
    # what bounds a small model's step. 1: one chained step per host pass. (draft: always 1)
    device_chain_steps: int = 4
    # draft model, batches without penalties or min_tokens bans (greedy or sampled): drafts stay on
    # the device and feed the verification's inputs there (no host sync per draft step; the
    # verification is staged while they run; sampled drafts keep their q there too)
    device_drafts: bool = True


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    enable_cuda_graphs: bool = True
    attention_backend: str = "auto"  # "auto" | "triton" | "reference"


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL_URI
    served_model_name: str | None = None
    revision: str | None = None
    seed: int = 0
    # > 1: the model split over this many processes and devices (engine/parallel/), rank 0 here
    tensor_parallel_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)

    @property
    def resolved_served_model_name(self) -> str:
        """The name clients put in `model`: the explicit one, else derived from the model URI
        (`builtin://smollm2-135m` -> `smollm2-135m`, `hf://org/name@rev` -> `org/name`, a path as given).
        """
        if self.served_model_name:
            return self.served_model_name
        for scheme in ("builtin://", "hf://"):
            if self.model.startswith(scheme):
                return self.model.removeprefix(scheme).split("@", 1)[0]
        return self.model


# How `pagedinfer serve` logs (the launcher, each server process and the CLI alike).
SERVER_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # WebSocket Origins beyond the same origin; "*": any
    # the models' tool-call format (server/tool_parsers.py); auto: chosen from the chat template
    tool_call_parser: str = "auto"
    allow_unknown_fields: bool = False  # accept (and log) request fields the API does not define
    max_header_bytes: int = 64 << 10  # HTTP: all request headers together (431 above)
    max_header_count: int = 100  # HTTP: request headers (431 above)
    max_ws_message_bytes: int = 1 << 20
    max_request_bytes: int = 4 << 20
    drain_timeout_seconds: float = 30.0
    enable_vllm_metrics: bool = True  # Gateway API Inference Extension names (vllm:*)
    # API-server processes (HTTP and gRPC) in front of one engine core (> 1: the core runs in its own
    # process and a launcher supervises them; see server/api_servers.py).
    api_server_count: int = 1

    @staticmethod
    def api_key_from_env() -> str | None:
        return os.environ.get("PAGEDINFER_API_KEY") or None
