"""`wafer-gpt2 generate "PROMPT"`: continue a prompt from the command line, streaming the text.

One request, one KV slot, driven by the engine core the server runs: the prompt streams through the
model in one step (only its last token's scores are needed), then one step per new token. Text goes to stdout as soon as it forms complete
UTF-8 characters; the timing line and the seed go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from wafer_gpt2.backends.registry import BACKENDS, DEFAULT_BACKEND, BackendOptions, build_backend
from wafer_gpt2.engine.core import EngineCore, gpt2_tokenizer_hooks
from wafer_gpt2.engine.request import ErrorEvent, FinishEvent, FinishReason, GenerationRequest, TokenEvent
from wafer_gpt2.engine.sampling import SamplingParams
from wafer_gpt2.errors import UserError
from wafer_gpt2.model import tokenizer
from wafer_gpt2.model.checkpoint import load_checkpoint, resolve_weights

WAFER_TOP_K = BackendOptions().top_k  # candidates the wafer returns per token


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt and print the text as it is generated",
        description="Continue PROMPT with GPT-2 and stream the continuation to stdout.",
    )
    parser.add_argument("prompt", help="the text to continue (empty: start from <|endoftext|>)")
    parser.add_argument(
        "--weights",
        help="an HF GPT-2 directory or an llm.c .bin (default: the embedded demo model)",
    )
    parser.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help="what runs the model")
    parser.add_argument("--dtype", choices=("fp16", "fp32"), default="fp16", help="wafer precision")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (64)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (1.0)")
    parser.add_argument(
        "--top-k", type=int, metavar="K", help=f"sample among the K best (at most {WAFER_TOP_K})"
    )
    parser.add_argument(
        "--top-p", type=float, metavar="P", help="sample from the smallest head with mass >= P"
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, metavar="R", help="HF-style penalty (1.0: off)"
    )
    parser.add_argument("--seed", type=int, metavar="S", help="seed for sampling (default: random, printed)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going after <|endoftext|>")
    parser.set_defaults(func=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    warpers = {
        "--temperature": args.temperature,
        "--top-k": args.top_k,
        "--top-p": args.top_p,
        "--seed": args.seed,
    }
    if args.greedy:
        given = [flag for flag, value in warpers.items() if value is not None]
        if given:
            raise UserError(f"--greedy cannot be combined with {', '.join(given)}")
    if args.top_k is not None and args.top_k > WAFER_TOP_K:
        raise UserError(
            f"--top-k {args.top_k} exceeds the {WAFER_TOP_K} candidates the wafer returns per token"
        )
    try:
        return SamplingParams(
            do_sample=not args.greedy,
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UserError(f"--{str(exc).replace('_', '-')}") from None


def run(args: argparse.Namespace) -> int:
    params_for_sampling = sampling_params(args)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompt = tokenizer.encode(args.prompt) or [tokenizer.EOT_ID]

    params = load_checkpoint(resolve_weights(args.weights), progress=True)
    context = params.config.n_positions
    if len(prompt) >= context:
        raise UserError(f"the prompt is {len(prompt)} tokens; the model's context is {context}")
    max_new = min(args.max_new_tokens, context - len(prompt))
    if max_new < args.max_new_tokens:
        print(
            f"note: stopping after {max_new} new tokens, at the end of the {context}-token context",
            file=sys.stderr,
        )

    backend = build_backend(
        args.backend,
        params,
        BackendOptions(slots=1, context=len(prompt) + max_new, dtype=args.dtype, top_k=WAFER_TOP_K),
    )
    # The engine core, as the server runs it: the prompt in one step (a budget that holds it whole),
    # then one step per token. Special tokens print as text (--ignore-eos goes on past <|endoftext|>).
    core = EngineCore(backend, gpt2_tokenizer_hooks(), max_queue=0, step_token_budget=len(prompt))
    request = GenerationRequest(
        tuple(prompt),
        max_new,
        sampling=params_for_sampling,
        ignore_eos=args.ignore_eos,
        skip_special_tokens=False,
    )
    state = core.add(request)
    first_token_s = None
    final: FinishEvent | None = None
    start = time.perf_counter()
    try:
        while final is None:
            for _, event in core.step():
                if first_token_s is None:
                    first_token_s = time.perf_counter() - start
                if isinstance(event, ErrorEvent):
                    raise event.error
                if isinstance(event, TokenEvent):
                    emit(event.token.released)
                elif isinstance(event, FinishEvent):
                    last = event.tokens[-1] if event.tokens else None
                    emit((last.released if last else "") + event.tail + "\n")
                    final = event
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        backend.close()

    ended_on_eos = final.finish_reason is FinishReason.EOS
    new_tokens = len(final.tokens) - ended_on_eos  # the end-of-text token is not text
    elapsed = time.perf_counter() - start
    sampler = state.sampler
    seed = f", seed {sampler.seed}" if sampler.seed is not None else ""
    print(
        f"[{new_tokens} tokens in {elapsed:.2f} s measured on backend {args.backend}: first token after "
        f"{first_token_s:.2f} s, {new_tokens / elapsed:.1f} tokens/s{seed}]",
        file=sys.stderr,
    )
    return 0


def emit(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
