"""Train the small GPT-2 that wafer-gpt2 ships as its default model.

Real GPT-2 weights cannot be downloaded everywhere the project runs, so the repository carries a small
checkpoint with GPT-2's exact architecture and vocabulary (50257 tokens, tied LM head) trained on the
fortune-cookie files of Debian's `fortunes` and `fortunes-min` packages. It writes English words,
not sense; its purpose is that the default generation is recognisable text and that every code path
(loaders, wafer plan, simulator, service) runs on a real Hugging Face checkpoint.

    apt-get install fortunes fortunes-min
    .venv/bin/python -m tools.train_demo --out wafer_gpt2/model/data/demo-gpt2 --minutes 15

The shipped model took two runs: one on the files' raw layout (`--keep-layout`), then one on the
cleaned text continuing from it (`--init-from`); `docs/demo-model.md` has the commands and numbers.

The output directory is a Hugging Face GPT-2 directory (`config.json`, `model.safetensors` in fp16,
`generation_config.json`, the GPT-2 tokenizer files) plus a `README.md` model card holding the run's numbers and samples.
Training uses torch on the CPU; the learning-rate schedule runs on the wall-clock budget, so the
run ends on time however busy the machine is.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import transformers

from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.hf_tokenizer import write_tokenizer_files
from wafer_gpt2.model.tokenizer import EOT_ID, VOCAB_SIZE, decode, encode

DEFAULT_DATA_DIR = Path("/usr/share/games/fortunes")
INSTALL_HINT = "install the training text with: apt-get install fortunes fortunes-min"
ATTRIBUTION = re.compile(r"^\s+--")  # an indented "-- Author" line: the end of a fortune's text
MIN_LETTER_FRACTION = 0.7
SAMPLE_PROMPTS = ("The meaning of life is", "A computer", "Never trust a man who")


class InputError(RuntimeError):
    """The training text or the checkpoint to start from is missing or unusable."""


# ----------------------------------------------------------------------------------------------------
# Data: fortune files -> list of fortunes -> one token stream per split


def read_fortunes(data_dir: Path) -> list[str]:
    """Every fortune in the strfile-format text files of `data_dir`, in file order.

    Fortunes are separated by lines holding only `%`. The `.dat` files are strfile's binary indexes
    and the `*.u8` names are symlinks to the same text, so both are skipped.
    """
    if not data_dir.is_dir():
        raise InputError(f"fortune directory {data_dir} does not exist; {INSTALL_HINT}")
    fortunes: list[str] = []
    for path in sorted(data_dir.iterdir()):
        if path.is_symlink() or not path.is_file() or path.suffix == ".dat":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        chunk: list[str] = []
        for line in text.splitlines():
            if line.strip() == "%":
                fortunes.append("\n".join(chunk).strip())
                chunk = []
            else:
                chunk.append(line.rstrip())
        fortunes.append("\n".join(chunk).strip())
    fortunes = [f for f in fortunes if f]
    if not fortunes:
        raise InputError(
            f"no fortunes found in {data_dir} (expected text files separated by '%' lines); {INSTALL_HINT}"
        )
    return fortunes


def clean_fortune(fortune: str) -> str | None:
    """One fortune as a single line of prose without its attribution, or None for pictures.

    The files are hard-wrapped near 72 columns and about half the fortunes end with an indented
    `-- Author, Source` line. A model this small trained on that layout spends itself on newlines,
    tabs and names, and greedy decoding loops on "-- Larry Wall in <message-id>"; so lines are joined,
    the attribution is cut, and ASCII art (under 70% letters and spaces) is dropped.
    """
    lines = []
    for line in fortune.splitlines():
        if ATTRIBUTION.match(line):
            break
        lines.append(line)
    prose = " ".join(" ".join(lines).split())
    letters = sum(ch.isalpha() or ch == " " for ch in prose)
    return prose if prose and letters >= MIN_LETTER_FRACTION * len(prose) else None


def split_fortunes(fortunes: list[str], holdout_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """A seeded shuffle, then the last `holdout_fraction` of it held out for the validation loss."""
    shuffled = list(fortunes)
    random.Random(seed).shuffle(shuffled)
    n_holdout = max(1, round(len(shuffled) * holdout_fraction))
    if n_holdout >= len(shuffled):
        raise InputError(
            f"only {len(shuffled)} fortunes: too few to hold out {holdout_fraction:.0%} and train"
        )
    return shuffled[:-n_holdout], shuffled[-n_holdout:]


def tokenize(fortunes: list[str]) -> torch.Tensor:
    """One stream of GPT-2 token ids, each fortune followed by `<|endoftext|>`."""
    ids: list[int] = []
    for fortune in fortunes:
        ids.extend(encode(fortune))
        ids.append(EOT_ID)
    return torch.tensor(np.array(ids, dtype=np.int64))


def random_batch(
    stream: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator
) -> torch.Tensor:
    """`batch_size` windows of `block_size + 1` tokens at random offsets (inputs and shifted targets)."""
    starts = torch.randint(0, len(stream) - block_size - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + block_size + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------------------------------
# Model and optimisation


@dataclass
class TrainSettings:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 256
    block_size: int = 128
    batch_size: int = 8
    learning_rate: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    minutes: float = 15.0
    max_steps: int | None = None
    holdout_fraction: float = 0.02
    eval_interval: int = 250
    log_interval: int = 25
    threads: int = 2
    seed: int = 1337


def build_model(settings: TrainSettings) -> transformers.GPT2LMHeadModel:
    """A freshly initialised GPT-2 with the project's config and no dropout (the run is short)."""
    shape = GPT2Config(
        n_layer=settings.n_layer,
        n_head=settings.n_head,
        n_embd=settings.n_embd,
        vocab_size=VOCAB_SIZE,
        n_positions=settings.n_positions,
        name="demo-gpt2",
    )
    hf_config = transformers.GPT2Config(**shape.to_hf_dict(), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(hf_config)


def load_model(directory: Path) -> transformers.GPT2LMHeadModel:
    """A GPT-2 checkpoint to continue training, in fp32 (it may be stored in fp16)."""
    if not (directory / "config.json").is_file():
        raise InputError(f"--init-from {directory}: no config.json (expected a Hugging Face GPT-2 directory)")
    model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32)
    if model.config.vocab_size != VOCAB_SIZE:
        raise InputError(
            f"--init-from {directory}: vocab_size {model.config.vocab_size}, expected {VOCAB_SIZE}"
        )
    return model


def make_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.95))


def learning_rate(step: int, progress: float, settings: TrainSettings) -> float:
    """Linear warmup over the first steps, then cosine decay to a floor over the run's progress (0..1)."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    floor = settings.min_lr_fraction
    return settings.learning_rate * (floor + (1.0 - floor) * cosine)


def next_token_loss(model: transformers.GPT2LMHeadModel, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting `batch[:, 1:]` from `batch[:, :-1]`."""
    logits = model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model: transformers.GPT2LMHeadModel, stream: torch.Tensor, block_size: int) -> float:
    """Mean next-token cross-entropy (nats) over all of `stream`, in consecutive windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, block_size):
        window = stream[start : start + block_size + 1]
        if len(window) < 2:
            break
        logits = model(window[:-1].unsqueeze(0)).logits[0]
        total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    model.train()
    return total / count


# ----------------------------------------------------------------------------------------------------
# Training loop


@dataclass
class RunSummary:
    n_fortunes_read: int
    n_fortunes_train: int
    n_fortunes_holdout: int
    train_tokens: int
    holdout_tokens: int
    n_params: int
    steps: int = 0
    tokens_seen: int = 0
    wall_seconds: float = 0.0
    final_train_loss: float = float("nan")
    final_holdout_loss: float = float("nan")
    fp16_holdout_loss: float = float("nan")
    log: list[dict] = field(default_factory=list)


def train(
    model: transformers.GPT2LMHeadModel,
    train_stream: torch.Tensor,
    holdout_stream: torch.Tensor,
    settings: TrainSettings,
    summary: RunSummary,
) -> None:
    """Run AdamW steps until the wall-clock budget (or `max_steps`) is spent, logging as it goes."""
    gen = torch.Generator().manual_seed(settings.seed)
    optimizer = make_optimizer(model, settings)
    budget_s = settings.minutes * 60.0
    tokens_per_step = settings.batch_size * settings.block_size
    recent: list[float] = []
    start = time.monotonic()
    model.train()
    step = 0
    while True:
        elapsed = time.monotonic() - start
        progress = elapsed / budget_s
        if settings.max_steps is not None:
            progress = max(progress, step / settings.max_steps)
        if progress >= 1.0:
            break
        lr = learning_rate(step, progress, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_batch(train_stream, settings.batch_size, settings.block_size, gen)
        loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1
        recent.append(loss.item())
        if step % settings.log_interval == 0:
            entry = {
                "step": step,
                "tokens": step * tokens_per_step,
                "minutes": round((time.monotonic() - start) / 60.0, 2),
                "lr": round(lr, 6),
                "train_loss": round(sum(recent) / len(recent), 4),
            }
            recent = []
            if step % settings.eval_interval == 0:
                entry["holdout_loss"] = round(mean_loss(model, holdout_stream, settings.block_size), 4)
            summary.log.append(entry)
            print(json.dumps(entry), flush=True)
    summary.steps = step
    summary.tokens_seen = step * tokens_per_step
    summary.wall_seconds = round(time.monotonic() - start, 1)


def estimate_train_loss(
    model: transformers.GPT2LMHeadModel,
    train_stream: torch.Tensor,
    settings: TrainSettings,
    n_batches: int = 8,
) -> float:
    """The trained model's mean loss on random training windows (a fixed seed, so runs compare)."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    model.eval()
    with torch.no_grad():
        losses = [
            next_token_loss(model, b).item()
            for b in (
                random_batch(train_stream, settings.batch_size, settings.block_size, gen)
                for _ in range(n_batches)
            )
        ]
    model.train()
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------------
# Samples and the model card


def generate_samples(model: transformers.GPT2LMHeadModel, seed: int, new_tokens: int = 40) -> list[dict]:
    """Greedy and seeded top-k sampled continuations of the fixed prompts."""
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([encode(prompt)])
        new_tokens = min(new_tokens, model.config.n_positions - ids.shape[1])  # stay within the context
        # transformers types generate's self as GenerativePreTrainedModel, which GPT2LMHeadModel mixes in
        greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=EOT_ID)  # type: ignore[misc]
        torch.manual_seed(seed)
        sampled = model.generate(  # type: ignore[misc]
            ids, max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=40, pad_token_id=EOT_ID
        )
        samples.append(
            {
                "prompt": prompt,
                "greedy": decode(greedy[0, ids.shape[1] :].tolist()),
                "sampled": decode(sampled[0, ids.shape[1] :].tolist()),
            }
        )
    return samples


def model_card(
    settings: TrainSettings,
    summary: RunSummary,
    samples: list[dict],
    command: str,
    size: int,
    args: argparse.Namespace,
) -> str:
    log_lines = "\n".join(json.dumps(entry) for entry in summary.log)
    sample_lines = []
    for s in samples:
        sample_lines.append(f"**Prompt:** `{s['prompt']}`\n")
        sample_lines.append(f"- greedy: `{s['greedy']!r}`")
        sample_lines.append(
            f"- sampled (temperature 0.8, top-k 40, seed {settings.seed}): `{s['sampled']!r}`\n"
        )
    start = "from scratch" if args.init_from is None else f"continuing from `{args.init_from}`"
    layout = (
        "The files' layout was kept as it is (`--keep-layout`)"
        if args.keep_layout
        else "Each fortune's lines are joined into one line, its indented `-- Author` attribution is cut, "
        "and ASCII art is dropped (`clean_fortune`)"
    )
    return f"""# demo-gpt2

A small GPT-2 ({settings.n_layer} layers, {settings.n_head} heads, n_embd {settings.n_embd},
{settings.n_positions} positions, GPT-2's 50257-token vocabulary, LM head tied to `wte`,
{summary.n_params:,} parameters) trained {start} by `tools/train_demo.py` on the
fortune-cookie files of Debian's `fortunes` and `fortunes-min` packages. It is wafer-gpt2's embedded
default model: it writes English words and fortune-like fragments, not sense. Weights are stored in
fp16 (`model.safetensors`, {size:,} bytes); load with `transformers.GPT2LMHeadModel.from_pretrained`.
GPT-2's tokenizer files (`vocab.json`, `merges.txt`, `tokenizer.json`, `tokenizer_config.json`) lie
beside them, built from the vendored ranks (`wafer_gpt2/model/hf_tokenizer.py`), for `AutoTokenizer`.

Training text: the fortune-mod data files in `{args.data_dir}`, distributed by Debian under the BSD
licence in `/usr/share/doc/fortunes/copyright` (Copyright (c) 1991 The Regents of the University of
California); the quotations are by their many credited authors. The offensive set (`fortunes-off`)
is not used. {layout}; each fortune ends with `<|endoftext|>`. See `docs/demo-model.md`.

## Run

    {command}

| | |
|---|---|
| fortunes read / kept as prose | {summary.n_fortunes_read} / {summary.n_fortunes_train + summary.n_fortunes_holdout} |
| fortunes (train / held out) | {summary.n_fortunes_train} / {summary.n_fortunes_holdout} |
| tokens (train / held out) | {summary.train_tokens:,} / {summary.holdout_tokens:,} |
| steps | {summary.steps} (batch {settings.batch_size} x {settings.block_size} tokens) |
| tokens seen | {summary.tokens_seen:,} ({summary.tokens_seen / summary.train_tokens:.2f} epochs) |
| wall time | {summary.wall_seconds / 60:.1f} min on {settings.threads} CPU threads |
| final train loss (fp32, 8 random batches) | {summary.final_train_loss:.3f} |
| final held-out loss (fp32, all held-out tokens) | {summary.final_holdout_loss:.3f} |
| held-out loss after fp16 storage | {summary.fp16_holdout_loss:.3f} |

Optimiser: AdamW (betas 0.9/0.95, weight decay {settings.weight_decay} on matrices), peak learning
rate {settings.learning_rate}, {settings.warmup_steps} warmup steps, cosine decay to
{settings.min_lr_fraction:.0%} of the peak over the wall-clock budget, gradient clipping
{settings.grad_clip}, seed {settings.seed}.

## Samples (from the fp16 checkpoint)

{chr(10).join(sample_lines)}
## Training log

```
{log_lines}
```
"""


# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, TrainSettings]:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python -m tools.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="fortune text files")
    parser.add_argument("--out", type=Path, required=True, help="output Hugging Face directory")
    parser.add_argument("--minutes", type=float, default=defaults.minutes, help="wall-clock training budget")
    parser.add_argument("--init-from", type=Path, default=None, help="continue from this HF GPT-2 directory")
    parser.add_argument(
        "--keep-layout", action="store_true", help="train on the files' raw layout (no clean_fortune)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (testing)")
    for name in ("n_layer", "n_head", "n_embd", "n_positions", "block_size", "batch_size", "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--eval-interval", type=int, default=defaults.eval_interval)
    parser.add_argument("--log-interval", type=int, default=defaults.log_interval)
    args = parser.parse_args(argv)
    settings = TrainSettings(**{k: getattr(args, k) for k in asdict(defaults) if hasattr(args, k)})
    if settings.block_size > settings.n_positions:
        parser.error(
            f"--block-size ({settings.block_size}) must not exceed --n-positions ({settings.n_positions})"
        )
    if settings.minutes <= 0:
        parser.error(f"--minutes must be positive, got {settings.minutes}")
    return args, settings


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    command = "python -m tools.train_demo " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)

    try:
        fortunes = read_fortunes(args.data_dir)
        # Split before cleaning, so runs with and without --keep-layout hold out the same fortunes.
        train_fortunes, holdout_fortunes = split_fortunes(fortunes, settings.holdout_fraction, settings.seed)
        model = build_model(settings) if args.init_from is None else load_model(args.init_from)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.keep_layout:
        train_fortunes = [text for text in map(clean_fortune, train_fortunes) if text]
        holdout_fortunes = [text for text in map(clean_fortune, holdout_fortunes) if text]
    train_stream, holdout_stream = tokenize(train_fortunes), tokenize(holdout_fortunes)
    if len(train_stream) <= settings.block_size + 1:
        print(
            f"error: {len(train_stream)} training tokens in {args.data_dir}, "
            f"need more than --block-size {settings.block_size}",
            file=sys.stderr,
        )
        return 2

    if args.init_from is not None:
        shape = model.config
        settings = replace(
            settings,
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            n_embd=shape.n_embd,
            n_positions=shape.n_positions,
        )
        if settings.block_size > settings.n_positions:
            print(
                f"error: --block-size {settings.block_size} exceeds {args.init_from}'s n_positions",
                file=sys.stderr,
            )
            return 2
    summary = RunSummary(
        n_fortunes_read=len(fortunes),
        n_fortunes_train=len(train_fortunes),
        n_fortunes_holdout=len(holdout_fortunes),
        train_tokens=len(train_stream),
        holdout_tokens=len(holdout_stream),
        n_params=sum(p.numel() for p in model.parameters()),
    )
    print(
        f"{len(fortunes)} fortunes, {len(train_fortunes) + len(holdout_fortunes)} kept ({summary.train_tokens:,} train / {summary.holdout_tokens:,} held-out tokens), "
        f"{summary.n_params:,} parameters, budget {settings.minutes} min",
        flush=True,
    )

    train(model, train_stream, holdout_stream, settings, summary)
    summary.final_train_loss = estimate_train_loss(model, train_stream, settings)
    summary.final_holdout_loss = mean_loss(model, holdout_stream, settings.block_size)

    # Store fp16 (the size limit and the wafer's default precision); measure what was stored.
    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out, safe_serialization=True)
    write_tokenizer_files(args.out, model.config.n_positions)  # clients pointed at the directory need it
    stored = transformers.GPT2LMHeadModel.from_pretrained(args.out, dtype=torch.float32)
    summary.fp16_holdout_loss = mean_loss(stored, holdout_stream, settings.block_size)
    samples = generate_samples(stored, settings.seed)
    size = (args.out / "model.safetensors").stat().st_size
    (args.out / "README.md").write_text(model_card(settings, summary, samples, command, size, args))
    print(
        json.dumps(
            {
                "steps": summary.steps,
                "tokens_seen": summary.tokens_seen,
                "wall_seconds": summary.wall_seconds,
                "final_train_loss": round(summary.final_train_loss, 4),
                "final_holdout_loss": round(summary.final_holdout_loss, 4),
                "fp16_holdout_loss": round(summary.fp16_holdout_loss, 4),
                "model_bytes": size,
            }
        )
    )
    for s in samples:
        print(json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
