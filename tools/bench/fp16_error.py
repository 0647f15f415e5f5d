"""How far the simulator's fp16 mode is from its fp32 mode, on the embedded demo model.

    python tools/bench/fp16_error.py [--weights DIR] [--new-tokens 16]

For each of 20 prompts: greedy continuation with the fp32 simulator; then the fp16 simulator is fed
the same tokens (teacher forcing) and every position's scores are compared: max |logit difference|
over the ids both top-k lists hold, max |log-sum-exp difference|, and whether the best token agrees.
Finally the fp16 simulator generates greedily on its own: how many continuations are identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from wafer_gpt2.backends.registry import BackendOptions, build_backend  # noqa: E402
from wafer_gpt2.core.steps import StepInputs, StepItem  # noqa: E402
from wafer_gpt2.engine.core import EngineCore, TokenizerHooks  # noqa: E402
from wafer_gpt2.engine.request import FinishEvent, GenerationRequest  # noqa: E402
from wafer_gpt2.engine.sampling import SamplingParams  # noqa: E402
from wafer_gpt2.model import tokenizer  # noqa: E402
from wafer_gpt2.model.checkpoint import load_checkpoint, resolve_weights  # noqa: E402

PROMPTS = [
    "The meaning of life is",
    "A computer",
    "Never trust a man who",
    "Once upon a time",
    "The best way to learn",
    "In the beginning",
    "My favourite food is",
    "Today the weather",
    "Love is",
    "The secret of success",
    "When I was young",
    "Money can't buy",
    "The cat sat on",
    "Programming is",
    "A friend in need",
    "Life is short",
    "The early bird",
    "Knowledge is power",
    "He who laughs last",
    "Time flies",
]


def teacher_forced(backend, tokens: list[int]) -> list:
    items = [StepItem(0, i, t) for i, t in enumerate(tokens)]
    backend.reset()
    return backend.step(StepInputs.of_items(items)).rows()


def greedy(backend, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation through the engine core (end-of-text ignored: always `new_tokens`)."""
    backend.reset()
    hooks = TokenizerHooks(tokenizer.token_bytes, tokenizer.EOT_ID, {tokenizer.EOT_ID: tokenizer.EOT_TEXT})
    core = EngineCore(backend, hooks, max_queue=0, step_token_budget=len(prompt))
    request = GenerationRequest(tuple(prompt), new_tokens, SamplingParams(do_sample=False), ignore_eos=True)
    core.add(request)
    while core.has_work():
        for _, event in core.step():
            if isinstance(event, FinishEvent):
                return [token.id for token in event.tokens]
    raise RuntimeError("the engine core ended the request without a result")


def measure(weights: str | None, new_tokens: int) -> dict:
    params = load_checkpoint(resolve_weights(weights), progress=False)
    context = max(len(tokenizer.encode(p)) for p in PROMPTS) + new_tokens
    options = {dtype: BackendOptions(slots=1, context=context, dtype=dtype) for dtype in ("fp32", "fp16")}
    fp32, fp16 = (build_backend("sim", params, options[d]) for d in ("fp32", "fp16"))
    worst_logit = worst_lse = 0.0
    positions = agree = identical = 0
    try:
        for prompt_text in PROMPTS:
            prompt = tokenizer.encode(prompt_text)
            continuation = greedy(fp32, prompt, new_tokens)
            tokens = prompt + continuation[:-1]
            for a, b in zip(teacher_forced(fp32, tokens), teacher_forced(fp16, tokens), strict=True):
                common, ia, ib = np.intersect1d(a.topk_ids, b.topk_ids, return_indices=True)
                worst_logit = max(worst_logit, float(np.abs(a.topk_logits[ia] - b.topk_logits[ib]).max()))
                worst_lse = max(worst_lse, abs(a.logsumexp - b.logsumexp))
                agree += int(a.topk_ids[0] == b.topk_ids[0])
                positions += 1
            identical += int(greedy(fp16, prompt, new_tokens) == continuation)
    finally:
        fp32.close()
        fp16.close()
    return {
        "prompts": len(PROMPTS),
        "positions": positions,
        "max_abs_logit_diff": worst_logit,
        "max_abs_lse_diff": worst_lse,
        "top1_agreement": agree / positions,
        "identical_greedy_continuations": identical,
        "new_tokens": new_tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", help="checkpoint (default: the embedded demo model)")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    r = measure(args.weights, args.new_tokens)
    print(
        f"fp16 vs fp32 simulator over {r['prompts']} prompts ({r['positions']} positions, measured): "
        f"max |logit diff| {r['max_abs_logit_diff']:.4g}, max |lse diff| {r['max_abs_lse_diff']:.4g}, "
        f"top-1 agreement {100 * r['top1_agreement']:.1f}%, identical greedy continuations of "
        f"{r['new_tokens']} tokens: {r['identical_greedy_continuations']}/{r['prompts']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
