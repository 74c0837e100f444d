"""EngineConfig: every knob a user can turn, with vLLM's names and defaults.

Owns validation of engine-level settings and the resolution of "auto" values
(dtype, device, max_model_len) once the model's config.json is known. Must not
build anything: it only describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_BACKENDS = ("auto", "torch", "triton")
_GRAPH_BACKENDS = ("auto", "cuda", "recording", "none")
_CUDAGRAPH_MODES = ("full_decode_only", "full_and_piecewise")


_VLLM_FIXED = {"pipeline_parallel_size": 1}
_VLLM_NO_EFFECT = {"trust_remote_code", "disable_log_stats"}
# vLLM switches for behaviour tinyengine always has: True is taken, False
# (asking it away) is an error.
_VLLM_ALWAYS_ON = {"enable_chunked_prefill"}


@dataclass
class EngineConfig:
    model: str = ""
    tokenizer: str | None = None  # folder with tokenizer.json; defaults to `model`
    dtype: str = "auto"  # "auto": the checkpoint's torch_dtype on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available
    # Tokens per KV-cache block. None: the model's choice on CUDA with the
    # Triton backend (DeepSeek: 64, so MLA decode reads whole pages through
    # TMA; vLLM forces 64 for FlashMLA likewise), else 16.
    block_size: int | None = None
    # None: a device default. CUDA: 256 sequences, 8192 tokens per step (vLLM's).
    # CPU: 16 and 512, because startup profiles and warms up the worst step
    # and a CPU step of 8192 tokens takes tens of seconds even for a 135M model.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Allow max_model_len past the model's max_position_embeddings (vLLM's
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN): RoPE caches are extended to cover it.
    allow_long_max_model_len: bool = False
    num_kv_blocks: int | None = None  # overrides KV sizing
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0  # KV budget on CPU, where there is no allocator to profile
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int | None = 0  # the shared sampler's seed; None: a fresh random one (vLLM's)
    # The op set (kernels/opset.py): "torch" runs torch references only,
    # "triton" the Triton kernels; "auto": triton on CUDA, torch on CPU.
    attention_backend: str = "auto"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # Where the weights come from (vLLM's name and values): "safetensors",
    # "dummy" (seeded random weights made on the device, nothing read;
    # models/dummy_weights.py), or "auto": safetensors, unless the folder is
    # a dummy-weight preset.
    load_format: str = "auto"
    # Threads that read the safetensors (models/loader.py), each copying to
    # the GPU on its own stream (vLLM's and SGLang's multithread load); 1
    # reads one tensor after another.
    load_threads: int = 8
    # Decode batch sizes to capture as CUDA graphs; None: 1, 2, 4, 8, then
    # every 8 up to max_num_seqs.
    cuda_graph_sizes: list[int] | None = None
    # "auto": real CUDA graphs on CUDA unless enforce_eager, none on CPU.
    # "recording": a CPU stand-in that checks captured workspace addresses at
    # every replay (tests use it to exercise capture/replay without a GPU).
    graph_backend: str = "auto"
    # Which steps replay graphs (vLLM's cudagraph_mode names):
    # "full_and_piecewise" (the default, as in vLLM): decode batches replay
    # whole-step graphs, and prefill and mixed steps of up to
    # piecewise_graph_sizes' largest token count replay graphs of everything
    # between attention calls (docs/startup.md); a short prompt's prefill
    # is then several times faster (docs/benchmarks.md). "full_decode_only":
    # only decode replays graphs, a shorter capture stage.
    cudagraph_mode: str = "full_and_piecewise"
    # Token counts piecewise graphs are captured for; None: 8, 16, 32, 48,
    # ... 512 (each at most 1.5x the last), then every 256 up to 2048, up to
    # max_num_batched_tokens.
    piecewise_graph_sizes: list[int] | None = None
    # Threads that compile Triton kernels during startup (worker/precompile.py:
    # a dry run of the startup's dummy forwards hands every kernel variant
    # to them at once). None: one per CPU core, up to 16; 0 or 1: each
    # variant compiles at its first launch, one after another.
    compile_threads: int | None = None
    # Print the startup state machine's report (a small table) when READY.
    print_startup_report: bool = True
    # Time each step's phases (schedule, prepare, forward on the GPU, sample,
    # output) for LLMEngine.step_profile(). Off: a step pays a few `is None` checks.
    profile_steps: bool = False
    # Schedule and launch step N+1 before waiting for step N's tokens, so the
    # host's scheduling, input preparation and output processing overlap the
    # GPU's forward (vLLM's async scheduling). Off: each step waits for its own
    # tokens before returning (simpler to follow; same tokens either way).
    async_scheduling: bool = True
    # Batch-invariant mode (docs/batch_invariance.md): a request's tokens and
    # logprobs are bitwise the same whatever else is in the batch, however
    # its prompt is chunked, cached or recomputed. On a GPU the Triton op set
    # keeps it with CUDA graphs for the Llama family and DeepSeek-V2/V3/V4
    # in bf16/fp16; elsewhere "auto" picks the torch op set, eager steps
    # (check_batch_invariant).
    batch_invariant: bool = False
    # Ranks the model is split over (tensor parallelism, docs/parallelism.md): this
    # process is rank 0 (scheduler, tokenizer, sampling) and starts one
    # worker process per other rank, each on its own GPU (or CPU process).
    tensor_parallel_size: int = 1
    # MoE layers: each rank holds whole experts (E / tensor_parallel_size of
    # them) instead of a slice of every expert (vLLM's expert parallelism).
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.hf_overrides is None:
            self.hf_overrides = {}
        self._validate()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        # vLLM options a vLLM script passes, taken so it runs unchanged: those
        # with the one value tinyengine has (one GPU), and those that change
        # nothing here (no code from the model folder is ever run; no periodic
        # stats log). Any other value is an error.
        for name, only in _VLLM_FIXED.items():
            if name in kwargs and kwargs.pop(name) != only:
                raise ValueError(
                    f"{name}: tinyengine has no pipeline parallelism; only {only} is supported "
                    "(tensor_parallel_size splits a model over several devices)"
                )
        for name in _VLLM_NO_EFFECT & set(kwargs):
            if not isinstance(kwargs.pop(name), bool):
                raise ValueError(f"{name} must be True or False")
        for name in _VLLM_ALWAYS_ON & set(kwargs):
            if kwargs.pop(name) is not True:
                raise ValueError(f"{name}: tinyengine always has it on; only True is supported")
        if kwargs.get("dtype") in _DTYPE_ALIASES:
            kwargs["dtype"] = _DTYPE_ALIASES[kwargs["dtype"]]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; valid options are {sorted(known - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")

        if self.dtype not in _DTYPES:
            raise bad("dtype", f"must be one of {_DTYPES}")
        if self.device not in _DEVICES:
            raise bad("device", f"must be one of {_DEVICES}")
        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"must be one of {_LOAD_FORMATS}")
        if self.attention_backend not in _BACKENDS:
            raise bad("attention_backend", f"must be one of {_BACKENDS}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "load_threads"):  # fmt: skip
            value = getattr(self, name)
            optional = value is None
            if not optional and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise bad(name, "must be a positive integer")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise bad("block_size", "must be a power of two")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be a positive integer or None")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be a positive integer or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise bad("cpu_kv_cache_gib", "must be > 0")
        if self.graph_backend not in _GRAPH_BACKENDS:
            raise bad("graph_backend", f"must be one of {_GRAPH_BACKENDS}")
        threads = self.compile_threads
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or threads < 0
        ):
            raise bad("compile_threads", "must be an integer >= 0 or None")
        if self.cudagraph_mode not in _CUDAGRAPH_MODES:
            raise bad("cudagraph_mode", f"must be one of {_CUDAGRAPH_MODES}")
        sizes = self.piecewise_graph_sizes
        if sizes is not None and (
            not isinstance(sizes, list | tuple)
            or not sizes
            or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes)
        ):
            raise bad("piecewise_graph_sizes", "must be a non-empty list of positive ints or None")
        for name in ("enable_prefix_caching", "enforce_eager", "print_startup_report",
                     "profile_steps", "async_scheduling",
                     "allow_long_max_model_len", "batch_invariant",
                     "enable_expert_parallel"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):  # "false" would be truthy
                raise bad(name, "must be True or False")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):  # fmt: skip
            raise bad("seed", "must be an integer (torch's generator range) or None")
        if self.batch_invariant and self.tensor_parallel_size != 1:
            raise ValueError(
                "EngineConfig.batch_invariant=True is not available with tensor_parallel_size > 1: "
                "the all-reduce's summation order is the collective library's, not the mode's"
            )
        if not isinstance(self.hf_overrides, dict):
            raise bad("hf_overrides", "must be a dict merged into config.json")

    # --- resolution of "auto" values (needs torch; imported lazily so the
    # scheduling layer can import this module without torch) ---

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device is 'cuda' but no CUDA device is available")
        return self.device

    def check_devices(self, device: str) -> None:
        """One GPU per tensor-parallel rank."""
        import torch

        if device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size} needs one GPU per "
                f"rank, but {torch.cuda.device_count()} are visible"
            )

    def resolve_limits(self, device: str) -> None:
        """Fill in the per-step limits left to the device default."""
        cuda = device == "cuda"
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if cuda else 16
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if cuda else 512
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes
            or any(
                not isinstance(s, int) or not 1 <= s <= self.max_num_seqs
                for s in self.cuda_graph_sizes
            )
        ):
            raise ValueError(
                "EngineConfig.cuda_graph_sizes must be a non-empty list of ints in "
                f"[1, max_num_seqs={self.max_num_seqs}], got {self.cuda_graph_sizes!r}"
            )

    def resolve_block_size(self, hf_config: dict[str, Any], device: str) -> int:
        """Fill in block_size left to the default: the model class's
        `cuda_block_size` on CUDA with the Triton backend (a kernel's
        preference, e.g. whole-page TMA loads), else 16."""
        if self.block_size is None:
            self.block_size = 16
            if device == "cuda" and self.resolved_attention_backend(device, hf_config) == "triton":
                from tinyengine.models.registry import get_model_class

                self.block_size = getattr(get_model_class(hf_config), "cuda_block_size", 16)
        return self.block_size

    def check_batch_invariant(self, hf_config: dict[str, Any], device: str) -> None:
        """Refuse batch_invariant=True where the mode cannot keep its promise
        yet, naming what is not covered (instead of a silent weaker mode)."""
        if not self.batch_invariant:
            return
        from tinyengine.models.registry import get_model_class

        model_class = get_model_class(hf_config)
        backend = self.resolved_attention_backend(device, hf_config)
        why = None
        if not getattr(model_class, "batch_invariant_ok", False):
            why = f"it does not cover {model_class.__name__} yet"
        elif backend == "triton" and not self._triton_invariant(hf_config, device):
            why = (f"its Triton ops cover the Llama family and DeepSeek-V2/V3/V4 in "
                   f"bfloat16/float16 on a GPU; use attention_backend='torch' for "
                   f"{model_class.__name__} here")  # fmt: skip
        elif backend == "torch" and self.graph_backend == "recording":
            why = "its torch ops need eager steps (graph_backend='auto')"
        if why:
            raise ValueError(f"EngineConfig.batch_invariant=True is not available here: {why}")

    def _triton_invariant(self, hf_config: dict[str, Any] | None, device: str) -> bool:
        """Whether the batch-invariant Triton ops (kernels/batch_invariant_triton.py)
        cover this model: on a GPU, a model class that says so, 16-bit weights."""
        if device != "cuda" or hf_config is None:
            return False
        import torch

        from tinyengine.models.registry import get_model_class

        return bool(getattr(get_model_class(hf_config), "batch_invariant_triton", False)) and (
            self.resolved_dtype(hf_config, device) in (torch.bfloat16, torch.float16)
        )

    def resolved_attention_backend(
        self, device: str, hf_config: dict[str, Any] | None = None
    ) -> str:
        """The op set "auto" stands for: Triton on a GPU, torch on a CPU; in
        batch-invariant mode torch unless the invariant Triton ops cover the
        model (hf_config says which)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if device != "cuda":
            return "torch"
        if self.batch_invariant and not self._triton_invariant(hf_config, device):
            return "torch"
        return "triton"

    def resolved_dtype(self, hf_config: dict[str, Any], device: str):  # -> torch.dtype
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device == "cpu":
            # CPU matmuls in half precision are slow and inexact; fp32 is the CPU default.
            return torch.float32
        name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
        dtype = getattr(torch, str(name).replace("torch.", ""), torch.bfloat16)
        return torch.bfloat16 if dtype == torch.float32 else dtype

    def resolve_max_model_len(self, hf_config: dict[str, Any]) -> int:
        limit = hf_config.get("max_position_embeddings")
        if self.max_model_len is None:
            if limit is None:
                raise ValueError(
                    "the model's config.json has no max_position_embeddings; set max_model_len"
                )
            self.max_model_len = int(limit)
        elif (
            limit is not None
            and self.max_model_len > int(limit)
            and not self.allow_long_max_model_len
        ):
            raise ValueError(
                f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit} (set allow_long_max_model_len=True to "
                "run past it)"
            )
        return self.max_model_len
