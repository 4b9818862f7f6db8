"""Time per detokenizer push at 100, 1k and 10k generated tokens.

Compares the window-diff ``IncrementalDetokenizer``, the ``DecodeStreamDetokenizer`` (what
``make_detokenizer`` returns for HF fast tokenizers), tokenizers' bare ``DecodeStream`` and a full
re-decode per push (the O(N) baseline), on the SmolLM2 tokenizer, for English text and for
CJK/emoji text (where most characters span several tokens and the window-diff falls back to a
full decode at each resolving token).  Per-push cost is measured over the last 200 pushes before
each length; medians over repeats.  Flat means the 10k cost is at most 2x the 100 cost.

    python benchmarks/bench_detok.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ratchetlm.text.detokenizer import DecodeStreamDetokenizer, IncrementalDetokenizer

LENGTHS = (100, 1_000, 10_000)
MEASURED = 200  # pushes timed just before each length (fewer for the first length)

ENGLISH = (
    "The scheduler admits requests while free KV blocks remain, then runs one step over the batch; "
    "each request commits the tokens its strategy accepted and streams them to the client. "
)
CJK_EMOJI = "今天天气很好，我们去公园散步吧。🫨 你好世界！👨\u200d👩\u200d👧 日本語のテキストも少し。👍🏽 "


class FullRedecode:
    """Baseline: decode everything on every push and diff against the emitted length."""

    def __init__(self, tok: Tokenizer, prompt: list[int]) -> None:
        self.tok, self.tokens = tok, list(prompt)
        self.emitted_len = len(tok.decode(self.tokens, skip_special_tokens=False))

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        full = self.tok.decode(self.tokens, skip_special_tokens=False)
        if full.endswith("\ufffd"):
            return ""
        new = full[self.emitted_len :]
        self.emitted_len = len(full)
        return new


class BareDecodeStream:
    """tokenizers' DecodeStream alone, primed with the prompt (no flush, no exactness fixes)."""

    def __init__(self, tok: Tokenizer, prompt: list[int]) -> None:
        self.tok, self.stream = tok, DecodeStream(ids=prompt, skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        return self.stream.step(self.tok, token_id) or ""


METHODS = {
    "window-diff": IncrementalDetokenizer,
    "DecodeStreamDetokenizer": DecodeStreamDetokenizer,
    "bare DecodeStream": BareDecodeStream,
    "full re-decode": FullRedecode,
}


def load_tokenizer() -> Tokenizer:
    from ratchetlm.models.loader import resolve
    from ratchetlm.models.tokenizer import load_tokenizer as load

    return load(resolve(None)).backend_tokenizer


def token_stream(tok: Tokenizer, text: str, n: int) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    return (ids * (n // len(ids) + 1))[:n]


def per_push_us(cls, tok: Tokenizer, prompt: list[int], gen: list[int], n: int) -> tuple[float, float]:
    """Median microseconds per push over the pushes just before ``n`` generated tokens."""
    measured = min(MEASURED, n)
    d = cls(tok, prompt)
    if cls is FullRedecode:  # skip the O(N^2) warm-up: its state is only the token list
        d.tokens.extend(gen[: n - measured])
        d.emitted_len = len(tok.decode(d.tokens, skip_special_tokens=False))
    else:
        for t in gen[: n - measured]:
            d.push(t)
    times = []
    for t in gen[n - measured : n]:
        t0 = time.perf_counter_ns()
        d.push(t)
        times.append(time.perf_counter_ns() - t0)
    return statistics.mean(times) / 1e3, statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer()
    prompt = tok.encode("<|im_start|>user\nWrite something long.<|im_end|>\n<|im_start|>assistant\n").ids
    for name, text in (("English", ENGLISH), ("CJK+emoji", CJK_EMOJI)):
        gen = token_stream(tok, text, max(LENGTHS))
        print(f"\n{name}: mean / median us per push (last {MEASURED} pushes), median of {args.repeats} runs")
        header = f"{'method':<26}" + "".join(f"{n:>20}" for n in LENGTHS) + f"{'10k/100 (mean)':>16}  flat"
        print(header)
        results = {}
        for label, cls in METHODS.items():
            row = []
            for n in LENGTHS:
                runs = [per_push_us(cls, tok, prompt, gen, n) for _ in range(args.repeats)]
                row.append((statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))
            results[label] = row
            ratio = row[-1][0] / row[0][0]
            cells = "".join(f"{f'{m:.1f} / {md:.1f}':>20}" for m, md in row)
            print(f"{label:<26}{cells}{ratio:>16.2f}  {'yes' if ratio <= 2 else 'NO'}")
        base = results["window-diff"]
        for label, row in results.items():
            if label != "window-diff":
                speed = " ".join(f"{base[i][0] / row[i][0]:.2f}x" for i in range(len(LENGTHS)))
                print(f"  window-diff time / {label} time (mean, per length): {speed}")


if __name__ == "__main__":
    main()
