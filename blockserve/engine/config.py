"""Engine settings, validated once, with vLLM's names where vLLM has one."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from blockserve.kv.specs import KV_CACHE_DTYPES, KV_SIDE_DTYPES, resolve_kv_dtypes, with_kv_cache_dtype
from blockserve.spec_decode.config import SpeculativeConfig

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def available_memory_bytes() -> int:
    """Memory the system could give us now (Linux MemAvailable; total RAM elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_memory(value: str | int | float) -> int:
    """'4GiB', '512MB', 1073741824 -> bytes; a number in (0, 1] -> that fraction of available memory."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 0 < value <= 1:
            return int(value * available_memory_bytes())
        if value > 1:
            return int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match and match.group(2).lower() in _UNITS:
            return parse_memory(float(match.group(1)) * _UNITS[match.group(2).lower()]
                                if match.group(2) else float(match.group(1)))
    raise ValueError(
        f"cannot read kv_cache_memory={value!r}: give bytes with a unit ('4GiB', '512MB') "
        f"or a fraction of available memory in (0, 1] (0.2)"
    )


def parse_bytes(value: str | int, name: str) -> int:
    """'16GiB', '512MB', 1073741824 -> a positive number of bytes; ValueError naming `name` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match and match.group(2).lower() in _UNITS and float(match.group(1)) * _UNITS[match.group(2).lower()] >= 1:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(f"cannot read {name}={value!r}: give a positive size in bytes with a unit ('16GiB', '512MB')")


DEFAULT_KV_CACHE_MEMORY = "1GiB"  # on the CPU, when kv_cache_memory is not given
# The attention backends' names (attention/paged_attention.py's BACKENDS, which imports torch);
# `blockserve -h` stays torch-free, and a test checks the two agree.
ATTENTION_BACKENDS = ("exact", "whole_block", "flex", "triton")
# The model dtypes (engine/device.py, which imports torch); auto: float32 on CPU, bfloat16 on CUDA.
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The GGUF block kernels' activations (models/quantized_linear.py's ACTIVATIONS; a test checks they agree).
QUANTIZED_ACTIVATIONS = ("float32", "int8", "int16")
# float32: transformers' logits and greedy tokens, and a prefill chunked differently (a prefix-cache
# hit, another batch) moves them by float rounding only; int8's rounding of x turns those ~1e-6
# differences into ~0.1 in logprobs, int16's into ~5e-4 (docs/performance.md). Both are opt-in.
DEFAULT_QUANTIZED_ACTIVATIONS = "float32"
# Who starts tensor-parallel ranks 1..N-1 (blockserve/distributed/executor.py).
DISTRIBUTED_EXECUTORS = ("spawn", "external")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. Each field's metadata is its command-line flag
    (blockserve/config_args.py): help, and where needed the flag's name and choices; fields
    with `"cli": False` are set in code only."""

    model: str | None = field(default=None, metadata={
        "help": "HF model directory or .gguf file (default: bundled SmolLM2-135M)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output in tokens (default: the model's maximum, capped at 8192)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block (a power of two)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "do not reuse the KV of earlier requests' identical prompt prefixes", "flag": "--no-prefix-caching"})
    state_checkpoint_share: float = field(default=0.25, metadata={
        "help": "models with recurrent-state layers: the share of the KV memory budget kept for state "
                "checkpoints, which prefix-cache hits restore (0: no hits for such models)"})
    state_checkpoint_interval: int = field(default=0, metadata={
        "help": "also checkpoint recurrent state every this many strides inside prompts (long shared "
                "documents); 0: only at prompt ends, turn ends and shared-prefix junctions"})
    # 0.75: chosen with benchmarks/hybrid_prefix_sim.py (docs/benchmarks.md).
    state_checkpoint_savings_weight: float = field(default=0.75, metadata={
        "help": "checkpoint eviction: weight in [0, 1] on the tokens a checkpoint saves over the one "
                "before it, against recency (0: least recently used)"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens computed in one engine step"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prompts over several steps", "cli": False})
    max_prefill_chunk: int | None = field(default=None, metadata={
        "help": "most prompt tokens of one request per step (None: the step's token budget)", "cli": False})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "admission order", "cli": False})
    device: str = field(default="auto", metadata={
        "help": "where the model runs: auto (cuda when available, else cpu), cpu, cuda or cuda:N"})
    dtype: str = field(default="auto", metadata={
        "help": "the model's weights and activations (auto: float32 on CPU, bfloat16 on CUDA; on the CPU a "
                "checkpoint's bfloat16/float16 linear and embedding weights stay 16-bit, float32 widens them); "
                "recurrent states stay float32", "choices": MODEL_DTYPES})
    kv_cache_memory: str | int | float | None = field(default=None, metadata={
        "help": "the KV cache's size: bytes with a unit (4GiB), or on the CPU a fraction of free memory "
                f"(default {DEFAULT_KV_CACHE_MEMORY} on the CPU; on CUDA the cache gets what "
                "--gpu-memory-utilization leaves unless this fixes its size)", "type": str})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "CUDA only: the fraction of the device's total memory the engine may use (weights, "
                "activations and KV cache; the KV cache gets what a profiling forward leaves; default 0.9)"})
    attention_backend: str = field(default="exact", metadata={
        "help": "paged attention flavour", "choices": ATTENTION_BACKENDS})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly (by default decode steps replay CUDA graphs where every "
                "layer can be captured, e.g. with --attention-backend flex)"})
    cuda_graph_sizes: tuple[int, ...] = field(default=(), metadata={
        "help": "CUDA: a decode batch size captured as a CUDA graph (repeatable; default: 1, 2, 4, ... and "
                "max_num_seqs); a decode step of n rows replays the smallest size >= n, larger ones run eagerly"})
    async_scheduling: bool = field(default=False, metadata={
        "help": "schedule and launch each step before the previous one's tokens are back, so the host's work "
                "overlaps the device's (CUDA; on the CPU the forward runs in the launch, so it cannot pay there). "
                "A request that a stop token ends computes one more token, which is dropped"})
    # Recurrent states keep the model's dtype; MLA latents take the float dtypes, int8 and fp8 (kv/specs.py).
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "K/V storage of attention layers (auto: the model's dtype; float16 halves KV memory "
                "and reads; int8 and fp8 (e4m3): one-byte codes and a float16 scale per head vector, about half "
                "of float16; int4: each head vector rotated (a fixed randomised Hadamard transform) then 4-bit "
                "codes with a float16 scale and minimum, 3.6x fewer bytes than float16 at head size 64; "
                "k8v4: int8 keys with int4 values, 2.5x fewer; attention still computes in float32)",
        "choices": KV_CACHE_DTYPES})
    k_cache_dtype: str | None = field(default=None, metadata={
        "help": "the keys' storage, overriding kv_cache_dtype for K (one of kv_cache_dtype's single dtypes); "
                "K and V may differ only as int8 or fp8 keys with int4 values", "choices": KV_SIDE_DTYPES})
    v_cache_dtype: str | None = field(default=None, metadata={
        "help": "the values' storage, overriding kv_cache_dtype for V (see k_cache_dtype)",
        "choices": KV_SIDE_DTYPES})
    kv_offload_dir: str | None = field(default=None, metadata={
        "help": "a directory for a disk tier behind the prefix cache: the KV of computed prompt blocks is written "
                "there off the step and read back, checksummed, by later requests and after a restart (keyed "
                "by the model's weights and KV format and the cache salt; engines may share it, under one cap)"})
    kv_offload_size: str = field(default="16GiB", metadata={
        "help": "the disk tier's size cap, bytes with a unit; least recently used entries go first"})
    kv_offload_queue: str = field(default="256MiB", metadata={
        "help": "bytes of blocks waiting for the second tier's writer thread; a block that would overfill it is "
                "not saved (counted in blockserve_kv_tier_writes_dropped_total), the step never waits"})
    kv_offload_memory: str | None = field(default=None, metadata={
        "help": "a host-memory tier of this size (bytes with a unit) in front of the disk tier, or alone (pays "
                "under a CUDA device pool); least recently used entries go first"})
    poison: bool = field(default=False, metadata={
        "help": "fill garbage KV blocks with NaN (debugging; also BLOCKSERVE_POISON=1)"})
    check_integrity: bool = field(default=False, metadata={
        "help": "run the KV books check after every step (also BLOCKSERVE_CHECK=1)", "cli": False})
    unsafe_disable_zeroing: bool = field(default=False, metadata={
        "help": "C1 tests only: ignore the derived zero flags", "cli": False})
    seed: int | None = field(default=0, metadata={"help": "seed for requests without their own", "cli": False})
    num_threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})
    adaptive_threads: bool = field(default=True, metadata={
        "help": "CPU: fixed thread count (by default the engine runs on fewer threads while other processes "
                "keep the CPUs busy, up to --num-threads; engine/thread_governor.py)",
        "flag": "--no-adaptive-threads"})
    # Applies when the engine loads the model (a LoadedModel passed in was loaded with load_model's own setting).
    quantized_matmul: bool = field(default=True, metadata={
        "help": "GGUF models: float32 weights only (by default the linear layers read the file's "
                "Q4_0/Q4_1/Q8_0 blocks: at every batch size with int8 or int16 activations; with float32 up "
                "to 128 rows on AVX-512, 64 on AVX2)",
        "flag": "--no-quantized-matmul"})
    quantized_activations: str = field(default=DEFAULT_QUANTIZED_ACTIVATIONS, metadata={
        "help": "GGUF blocks: the activations' precision in their matmuls. float32 (default): exact "
                "(transformers' logits and greedy tokens); int8: rounded per block of 32 as llama.cpp does, "
                "~1.6-1.9x faster batch-1 decode on AVX2 (about even on AVX-512), logits ~0.2 off transformers' "
                "on average; int16: rounded per block of 32 to 16 bits, logits ~1e-3 off on average, "
                "faster than float32 at batch 1 on AVX2", "choices": QUANTIZED_ACTIVATIONS})
    quantized_max_rows: int | None = field(default=None, metadata={
        "help": "GGUF blocks with float32 or int16 activations: the most rows (batched tokens) they serve, "
                "the float32 GEMM past that (default: measured on this CPU as the model loads, at most 128 "
                "on AVX-512, 64 on AVX2; a fixed value makes runs repeatable to the bit)"})

    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "help": "speculative decoding, as a JSON object in vLLM's shape, e.g. '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or "
                "'{\"method\": \"suffix\"}' or '{\"method\": \"draft_model\", \"model\": \"PATH\"}' or "
                "'{\"method\": \"mtp\"}' (the checkpoint's multi-token-prediction layer) "
                "(docs/speculative.md); greedy outputs stay identical and sampling "
                "keeps the model's distribution",
        "type": str})

    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks (processes; gloo on CPU) that each hold a 1/N shard of the model's heads (recurrent "
                "state too), MLP and vocabulary"})
    distributed_executor: str = field(default="spawn", metadata={
        "help": "who starts ranks 1..N-1: spawn (the engine, on this host) or external (a launcher such as "
                "torchrun, each rank joining with env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; "
                "workers run `python -m blockserve.distributed.worker`)", "choices": DISTRIBUTED_EXECUTORS})
    distributed_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds a tensor-parallel rank may take for one step's communication before the engine "
                "fails every request and stops (and to join the group once every rank has started)"})
    distributed_startup_timeout_s: float = field(default=600.0, metadata={
        "help": "seconds the tensor-parallel ranks may take to join and to load their shards"})

    json_max_integer_digits: int = field(default=16, metadata={
        "help": "digits a JSON number's integral part may have in the grammars built from JSON schemas and "
                "json_object, where the schema sets no bound of its own (1-18; llama.cpp's 16)"})
    json_max_fraction_digits: int = field(default=10, metadata={
        "help": "digits a JSON number's fraction may have there (0-10)"})
    json_max_whitespace: int = field(default=20, metadata={
        "help": "characters of whitespace between two JSON tokens, for schemas that ask for flexible "
                "whitespace (x-guidance whitespace_flexible) without a pattern of their own"})

    @property
    def json_bounds(self):
        """The bounds the engine's JSON grammars write into schemas (structured/json_bounds.py)."""
        from blockserve.structured.json_bounds import JsonBounds

        return JsonBounds(self.json_max_integer_digits, self.json_max_fraction_digits, self.json_max_whitespace)

    def __post_init__(self) -> None:
        from blockserve.attention.paged_attention import BACKENDS

        try:
            _ = self.json_bounds  # built (and so checked) once here, not first when a grammar compiles
        except ValueError as e:  # JsonBounds names its own field, which this config prefixes with json_
            raise ValueError(f"json_{e}") from None

        # Given as a JSON string (the command line) or a mapping (LLM(...)): kept parsed and validated.
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose one of {sorted(BACKENDS)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
            if self.gpu_memory_utilization is not None:
                raise ValueError("give kv_cache_memory (the KV cache's size) or gpu_memory_utilization (a share of "
                                 "the GPU, the cache getting what the model leaves), not both")
        if not 0 <= self.state_checkpoint_share < 1:
            raise ValueError(f"state_checkpoint_share must be in [0, 1), got {self.state_checkpoint_share}")
        if self.state_checkpoint_interval < 0:
            raise ValueError(f"state_checkpoint_interval must be >= 0 (0: off), got {self.state_checkpoint_interval}")
        if not 0 <= self.state_checkpoint_savings_weight <= 1:
            raise ValueError("state_checkpoint_savings_weight must be in [0, 1], got "
                             f"{self.state_checkpoint_savings_weight}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_executor not in DISTRIBUTED_EXECUTORS:
            raise ValueError(f"unknown distributed_executor {self.distributed_executor!r}; "
                             f"choose one of {list(DISTRIBUTED_EXECUTORS)}")
        if self.distributed_timeout_s <= 0 or self.distributed_startup_timeout_s <= 0:
            raise ValueError("distributed_timeout_s and distributed_startup_timeout_s must be positive, got "
                             f"{self.distributed_timeout_s} and {self.distributed_startup_timeout_s}")
        from blockserve.engine.device import check_device_name

        check_device_name(self.device)
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {list(MODEL_DTYPES)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"unknown quantized_activations {self.quantized_activations!r}; choose one of "
                             f"{list(QUANTIZED_ACTIVATIONS)}")
        if self.quantized_max_rows is not None and self.quantized_max_rows < 0:
            raise ValueError(f"quantized_max_rows must be >= 0 (0: the blocks serve no rows), got "
                             f"{self.quantized_max_rows}")
        if any(size < 1 or size > self.max_num_seqs for size in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be batch sizes from 1 to max_num_seqs ({self.max_num_seqs}), "
                             f"got {list(self.cuda_graph_sizes)}")
        if self.cuda_graph_sizes and self.enforce_eager:
            raise ValueError("cuda_graph_sizes asks for CUDA graphs and enforce_eager forbids them: give one")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling runs on one device: it cannot be combined with tensor_parallel_size > 1")
        parse_bytes(self.kv_offload_size, "kv_offload_size")
        parse_bytes(self.kv_offload_queue, "kv_offload_queue")
        if self.kv_offload_memory is not None:
            parse_bytes(self.kv_offload_memory, "kv_offload_memory")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir / kv_offload_memory are tiers of the prefix cache: they need prefix "
                             "caching on")
        if self.kv_offload_memory is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_memory keeps blocks in one process's memory, and under tensor parallelism "
                             "each rank's KV is in its own process: use kv_offload_dir (a directory every rank "
                             "reaches) with tensor_parallel_size > 1")
        resolve_kv_dtypes(self.kv_cache_dtype, self.k_cache_dtype, self.v_cache_dtype)

    def kv_spec(self, spec):
        """A layer's spec with its K/V stored as kv_cache_dtype, k_cache_dtype and v_cache_dtype choose."""
        return with_kv_cache_dtype(spec, self.kv_cache_dtype, self.k_cache_dtype, self.v_cache_dtype)

    def kv_cache_bytes(self) -> int:
        """kv_cache_memory in bytes (DEFAULT_KV_CACHE_MEMORY when not given): the CPU's KV budget (on
        CUDA, engine/kv_budget.py's fixed_cuda_kv_bytes reads a given kv_cache_memory)."""
        value = DEFAULT_KV_CACHE_MEMORY if self.kv_cache_memory is None else self.kv_cache_memory
        return parse_memory(value)

    @property
    def kv_offload_enabled(self) -> bool:
        """A second tier (disk, host memory or both) is configured."""
        return self.kv_offload_dir is not None or self.kv_offload_memory is not None

    @property
    def poison_enabled(self) -> bool:
        return self.poison or os.environ.get("BLOCKSERVE_POISON") == "1"

    @property
    def check_enabled(self) -> bool:
        return self.check_integrity or os.environ.get("BLOCKSERVE_CHECK") == "1"
