"""What a user would pick instead of the wafer: published figures, each with its source, and the
memory-bandwidth floor of a GPU for batch-1 decode computed from vendor datasheets.

Nothing here was measured on a GPU: no GPU is attached to the machines this project runs on. Every
number is either copied from the source named beside it or computed from such numbers by the
formula stated in `bandwidth_floor`.
"""

from __future__ import annotations

from dataclasses import dataclass

from wafer_gpt2.model.config import GPT2Config

FP16_BYTES = 2


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    source: str


# HBM bandwidth from the vendor datasheets.
GPUS = (
    Gpu(
        "NVIDIA A100 40GB SXM",
        1.555e12,
        "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): "
        "GPU memory bandwidth 1,555 GB/s",
    ),
    Gpu(
        "NVIDIA A100 80GB SXM",
        2.039e12,
        "NVIDIA A100 Tensor Core GPU datasheet (same document): GPU memory bandwidth 2,039 GB/s",
    ),
    Gpu(
        "NVIDIA H100 SXM",
        3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM GPU memory bandwidth 3.35 TB/s",
    ),
)


@dataclass(frozen=True)
class PublishedFigure:
    system: str  # the hardware and software that produced it
    model: str
    setting: str  # batch, precision, what was timed
    tokens_per_s: float
    source: str  # where it was published (title and address)
    derivation: str = ""  # how the figure follows from the source's own numbers, when not quoted as is
    one_stream: bool = True  # one sequence at a time (comparable with single-stream decode)


PUBLISHED = (
    PublishedFigure(
        "NVIDIA V100, Hugging Face transformers (PyTorch), greedy with KV cache",
        "GPT-2 124M",
        "batch 1 (one query at a time), 100 queries x 64 new tokens",
        6400 / 78.04,
        "Microsoft batch-inference documentation, 'GPT Completion' example, "
        "https://microsoft.github.io/batch-inference/examples/gpt_completion.html",
        "6,400 tokens in 78.04 s",
    ),
    PublishedFigure(
        "NVIDIA V100, Hugging Face transformers (PyTorch), greedy with KV cache",
        "GPT-2 124M",
        "dynamic batching, max batch 32 (average 25), same 100 queries",
        6400 / 4.86,
        "Microsoft batch-inference documentation, 'GPT Completion' example (as above)",
        "6,400 tokens in 4.86 s",
        one_stream=False,
    ),
    PublishedFigure(
        "NVIDIA A100 80GB, nanoGPT baseline (PyTorch, fp32, no KV cache)",
        "GPT-2 XL 1558M",
        "one sequence at a time, 300 tokens, top-k sampling",
        62.03,
        "N. J. Kumar, 'Calculating GPT-2's Inference Speedups', https://njkumar.com/calculating-gpt2s-inference-speedups",
    ),
    PublishedFigure(
        "Cerebras Inference (CS-3 systems, WSE-3), 16-bit weights",
        "Llama 3.1 8B",
        "output tokens/s per user",
        1800,
        "Cerebras, 'Introducing Cerebras Inference: AI at Instant Speed', 27 Aug 2024, "
        "https://cerebras.ai/blog/introducing-cerebras-inference-ai-at-instant-speed",
    ),
    PublishedFigure(
        "Cerebras Inference (CS-3 systems, WSE-3), 16-bit weights",
        "Llama 3.1 70B",
        "output tokens/s per user",
        450,
        "Cerebras, 'Introducing Cerebras Inference: AI at Instant Speed' (as above)",
    ),
)


def decode_bytes_per_token(config: GPT2Config, context: int = 0) -> int:
    """Bytes a GPU must read from HBM for one batch-1 decode token in fp16: every weight once (the LM
    head reads all of wte, tied with the embedding), only one row of the position table, and the
    K and V of `context` earlier positions in every layer."""
    weights = config.n_params - (config.n_positions - 1) * config.n_embd
    kv = 2 * config.n_layer * config.n_embd * context
    return FP16_BYTES * (weights + kv)


@dataclass(frozen=True)
class BandwidthFloor:
    gpu: Gpu
    model: str
    bytes_per_token: int
    seconds_per_token: float

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token


def bandwidth_floor(config: GPT2Config, gpu: Gpu, context: int = 0) -> BandwidthFloor:
    """The shortest time a batch-1 decode token can take on `gpu`: bytes read / HBM bandwidth. A real
    GPU run is slower (kernel launches, imperfect bandwidth use); this is the floor, not a forecast."""
    nbytes = decode_bytes_per_token(config, context)
    return BandwidthFloor(gpu, config.name, nbytes, nbytes / gpu.hbm_bytes_per_s)
