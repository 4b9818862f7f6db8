"""What ``numerics="auto"`` runs a model in, and the one start-up line that says why.

Three tiers (docs/models.md#numerics-tiers): ``exact`` (HF-identical), ``int16`` (closer to exact than
llama.cpp: top-1 agreement 99.95% with exact on both real models), ``int8`` (llama.cpp-grade: no farther from exact
than llama-cpp-python on the same file, benchmarks/bench_numerics.py). All three are batch invariant
(speculative == plain, alone == batched). ``auto`` picks, for a quantized GGUF on a CPU whose integer
kernels have a vector form, the fastest mode measured llama.cpp-grade on a real model of that weight
format: int8 where one was measured grade (Q4_1, Q4_K_M, Q8_0, Q6_K, Q5_K_M: the table below; half the integer
work of int16: a 512-token prefill 1.28x int16's speed on Gemma 3 270M, 1.55-1.65x on the 1B files, decode at
batch 1 1.00-1.06x: docs/models.md, README), int16 for every other format (random-weight files say nothing about
quality, so no format gets int8 without a real model measured). Everything else runs exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the integer dot products with a vector form: AVX512-VNNI, faster than exact at every row count; AVX2
# (vpmaddubsw / vpmaddwd): decode ~4x exact's speed (an AVX2 build of the kernels here: bundled model 184
# vs 43 tok/s, 1B Q4_K_M 33.6 vs 7.6), prefill 0.4-0.6x (233 vs 610, 47 vs 78 tok/s): generation is mostly
# decode. The portable C loop (no AVX2) is 3x slower than exact at decode, 20x at prefill: exact there.
FAST_INT_ISAS = ("avx512vnni", "avx2")

# int8 per GGUF weight format (general.file_type), where a real model of that format measured llama.cpp-grade
# in int8: `benchmarks/bench_numerics.py [--model FILE]` (teacher-forced windows of 512 over
# benchmarks/data/public_domain.txt, each run against exact; llama-cpp-python 0.3.36 on the same file,
# token ids, windows and threads), 2026-11-28, top-1 agreement / mean |d log p| / perplexity change:
#   Q4_K_M  Gemma 3 270M, 2048 positions: llama-cpp-python 92.29% / 0.169 / +0.47%; int8 93.99% / 0.120 /
#           +0.08% (grade on all three); int16 99.95% / 0.0017 / -0.01%
#   Q4_1    SmolLM2-135M-Instruct (the default model), 2097 positions: llama-cpp-python 95.18% / 0.0716 /
#           +0.49%; int8 94.95% / 0.0699 / +0.53% (grade: 0.23 pp more top-1 disagreement, within the 0.5 pp
#           tolerance); int16 99.95% / 0.0009 / -0.00%
#   Q8_0, Q6_K, Q5_K_M  SmolLM2-135M-Instruct requantized into the format by llama.cpp's own quantizer
#           (llama_model_quantize, allow_requantize: a real model whose weights are stored in that format), 2097
#           positions: Q8_0 llama-cpp-python 95.09% / 0.0720 / +0.38%, int8 95.28% / 0.0696 / +0.79% (perplexity
#           within the 0.5% tolerance); Q6_K 94.99% / 0.0920 / +0.94%, int8 95.42% / 0.0727 / +0.20%; Q5_K_M
#           93.99% / 0.1038 / +0.54%, int8 94.95% / 0.0794 / +0.45% (grade on all three)
#   Q6_K, Q5_K_M  Gemma 3 270M (base) requantized the same way from its Q4_K_M file, 2048 positions, 2026-11-28:
#           Q6_K llama-cpp-python 90.53% / 0.2138 / +3.89%, int8 94.14% / 0.1073 / -0.21%; Q5_K_M 90.72% / 0.1849
#           / +0.95%, int8 94.34% / 0.1071 / +0.49% (grade on all three, both files)
#   (Hidden sizes 576 and 640 are not multiples of 256: llama.cpp stores those matrices of a K-quant file as
#   Q8_0 / Q5_1 and only the wider ones as Q6_K / Q5_K, so the evidence is for the file type, which is what
#   auto keys on.) int8 prefills 512 tokens 1.55-1.65x int16's speed on the 1B files.
INT8_GRADE_FILE_TYPES: dict[str, str] = {
    "Q4_K_M": "Gemma 3 270M",
    "Q4_1": "SmolLM2-135M-Instruct",
    "Q8_0": "SmolLM2-135M-Instruct requantized",
    "Q6_K": "SmolLM2-135M-Instruct and Gemma 3 270M requantized",
    "Q5_K_M": "SmolLM2-135M-Instruct and Gemma 3 270M requantized",
}
OTHER_FORMATS = "int16"  # closer to exact than llama.cpp on every file measured
# (format, integer ISA) where int16, closer to exact, is also the faster mode: Q8_0 on AVX2, whose int8 path
# splits each weight byte into nibbles (two vpmaddubsw + two vpmaddwd per vector and token) where int16 makes
# one vpmaddwd per activation half: 1B Q8_0, 512-token prefill, AVX2 build, 1 thread vs llama-cpp-python's
# AVX2 build, int8 0.95x (2026-11-28 20:25, load 1.9) against int16's 1.27x (17:23-17:30, load 1.4), decode
# 1.63x against 1.67x (docs/benchmarks.md). On AVX512-VNNI int8 is faster (prefill 2.62x against 1.74x).
INT16_FASTER: frozenset[tuple[str, str]] = frozenset({("Q8_0", "avx2")})


@dataclass(frozen=True)
class NumericsChoice:
    numerics: str  # "exact" | "int8" | "int16"
    reason: str

    def describe(self) -> str:
        return f"numerics={self.numerics} ({self.reason})"


def file_type(reader: Any) -> str | None:
    """The GGUF's weight format as llama.cpp names it ("Q4_K_M", "Q8_0", ...): ``general.file_type``."""
    if reader is None or reader.get("general.file_type") is None:
        return None
    import gguf

    code = int(reader.get("general.file_type"))
    try:
        return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {code}"


def choose_auto(weight_format: str | None, has_int_weights: bool, int_isa: str | None) -> NumericsChoice:
    """``numerics="auto"`` for a model whose weights are in ``weight_format`` (None: not a GGUF), which has
    block weights with integer values (``has_int_weights``: a quantized GGUF on CPU in fp32 with the kernels
    built) or not, on a CPU whose integer dot product is ``int_isa``."""
    if not has_int_weights:
        return NumericsChoice("exact", "auto: no quantized block weights here")
    if int_isa not in FAST_INT_ISAS:
        return NumericsChoice("exact", f"auto: no vector integer dot product on this CPU ({int_isa})")
    if weight_format is not None and (weight_format, int_isa) in INT16_FASTER:
        return NumericsChoice("int16", f"auto: {weight_format} weights on {int_isa}, where int16 measured "
                                       "faster than int8 and is closer to exact")
    if weight_format in INT8_GRADE_FILE_TYPES:
        return NumericsChoice("int8", f"auto: {weight_format} weights, llama.cpp-grade in int8 as measured on "
                                      f"{INT8_GRADE_FILE_TYPES[weight_format]}")
    return NumericsChoice(OTHER_FORMATS, f"auto: {weight_format or 'these'} weights, no real model of the format "
                                         "measured llama.cpp-grade in int8")
