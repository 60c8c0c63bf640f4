"""A real `pagedinfer serve` process on loopback, one per test module (fixture `server`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

DEFAULT_MODEL = os.environ.get("PAGEDINFER_TEST_MODEL", "builtin://smollm2-135m")
# Small, fast defaults for 2-core CI: a short context keeps the KV pool small.
DEFAULT_ARGS = ("--device", "cpu", "--max-model-len", "1024", "--max-num-seqs", "8", "--drain-timeout", "20")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    """Starts the CLI in a subprocess; `wait_ready` polls /ready; `stop` sends SIGTERM."""

    extra_args: Sequence[str] = ()
    model: str = DEFAULT_MODEL
    env: dict[str, str] = field(default_factory=dict)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        while self.grpc_port == self.http_port:  # (the OS may hand the same free port out twice)
            self.grpc_port = free_port()

    log_path: Path | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}/v1/ws"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> ServerProc:
        argv = [sys.executable, "-m", "pagedinfer.engine.cli", "serve", "--model", self.model]
        argv += [
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
        ]
        argv += [*DEFAULT_ARGS, *self.extra_args]
        fd, name = tempfile.mkstemp(prefix="pagedinfer-serve-", suffix=".log")
        self.log_path = Path(name)
        # One torch thread: on 2 cores shared with the test's own clients, OpenMP workers
        # oversubscribe the CPU and make steps 10-20x slower and erratic.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env}
        # cwd outside the repository: a root-level operator/ must never shadow the stdlib.
        self.proc = subprocess.Popen(
            argv, stdout=fd, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
        )
        os.close(fd)
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 240.0) -> ServerProc:
        deadline = time.monotonic() + timeout
        rebinds = 0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                # A port free_port() saw free can be taken before the server binds it (another
                # process, or the other of this server's two ports): start again on fresh ports.
                if "address already in use" in self.log() and rebinds < 3:
                    rebinds += 1
                    self.http_port, self.grpc_port = free_port(), free_port()
                    self.start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.http}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def engine_stats(self) -> dict:
        return httpx.get(f"{self.http}/debug/engine_stats", timeout=10).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until no request is in flight and every KV block is free again; returns the stats."""
        deadline = time.monotonic() + timeout
        stats = self.engine_stats()
        while time.monotonic() < deadline:
            stats = self.engine_stats()
            engine = stats["engine"] or {}
            busy = engine.get("num_running", 0) + engine.get("num_waiting", 0)
            if stats["num_in_flight"] == 0 and busy == 0 and blocks_all_free(engine):
                return stats
            time.sleep(0.1)
        raise AssertionError(f"server did not become idle: {stats}")


def blocks_all_free(engine_stats: dict) -> bool:
    free, total = engine_stats.get("kv_free_blocks"), engine_stats.get("kv_total_blocks")
    if free is None or total is None:
        raise AssertionError(f"engine.stats() lacks kv_free_blocks/kv_total_blocks: {sorted(engine_stats)}")
    return free == total


# A chat template in the SmolLM2 (ChatML) style for the tiny model's byte-level tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama with a byte-level tokenizer (256 bytes + 2 specials): fast on any CPU."""
    import json

    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TINY_CHAT_TEMPLATE}
        )
    )
    config = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if name.endswith("norm.weight") else param.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the tiny random model folder (built once per test session)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def server_proc_cls() -> type[ServerProc]:
    """The ServerProc class (test modules build one module-scoped server each)."""
    return ServerProc


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProc]:
    """One server per test module. A module sets `SERVER_ARGS = (...)` for extra flags and
    `SERVER_MODEL = "tiny"` to serve the tiny random model instead of SmolLM2."""
    extra = getattr(request.module, "SERVER_ARGS", ())
    model = DEFAULT_MODEL
    if getattr(request.module, "SERVER_MODEL", None) == "tiny":
        model = request.getfixturevalue("tiny_model")
    proc = ServerProc(extra_args=extra, model=model).start()
    try:
        yield proc.wait_ready()
    finally:
        code = proc.stop()
        assert code == 0, f"server exited with {code}:\n{proc.log()[-4000:]}"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official OpenAI SDK on the module's server (no retries: errors show as they are)."""
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's name, as the server lists it."""
    return client.models.list().data[0].id
