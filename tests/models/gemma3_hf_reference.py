"""HF transformers' GGUF loader on the real Gemma 3 270M file: reference logits and greedy text,
run as its own process (``python -m tests.models.gemma3_hf_reference GGUF OUT``) so that the
~3 GB it takes while loading is returned before the engine's model loads in the test process."""

from __future__ import annotations

import sys

import torch

TEXT = "The history of the ratchet begins with simple pawls and toothed wheels. " * 50  # ~750 tokens
# 12 greedy tokens after a 600-token prompt: every step attends across the 512-token window's edge (24 before;
# each HF step is a 262k-row head in fp32, ~0.15 s of CPU)
GREEDY_PROMPT, GREEDY_TOKENS = 600, 12
SHORT = "The capital of France is"  # the example: without its BOS, Gemma degenerates
SHORT_TOKENS = 12  # (20 before)


def main(gguf: str, out: str) -> None:
    from pathlib import Path

    import transformers
    from transformers import AutoTokenizer

    from tests.models.hf_gguf import gguf_parsed_once

    transformers.logging.set_verbosity_error()
    p = Path(gguf)
    # HF parses the file's metadata afresh for the tokenizer, the config and the weights, through gguf-py's
    # memmap reader (~28 s of CPU each for Gemma's 262k-token vocabulary): one parse on a plain array serves
    # all three (tests/models/hf_gguf.py: the same bytes through the same parsers)
    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                               dtype=torch.float32).eval()
    ids = tok.encode(TEXT)  # HF's default tokenization: the BOS the tokenizer adds
    # the converted tokenizer (~5 s of CPU for Gemma's vocabulary), for the test process: the engine's own
    # load runs the same converter (ratchetlm/models/tokenizer.py) and keeps its result in the same form
    tok.save_pretrained(str(Path(out).with_name("hf_tokenizer")))
    short = tok.encode(SHORT)
    rows = list(range(0, len(ids) - 5, 37)) + list(range(len(ids) - 5, len(ids)))
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
        logits = hf.lm_head(hidden[rows]).float()
        gen = hf.generate(torch.tensor([ids[:GREEDY_PROMPT]]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
        short_lp = torch.log_softmax(hf(torch.tensor([short])).logits[0].float(), -1)
        short_gen = hf.generate(torch.tensor([short]), max_new_tokens=SHORT_TOKENS, do_sample=False)
    short_out = short_gen[0, len(short):].tolist()
    torch.save({"ids": ids, "rows": rows, "logits": logits, "greedy": gen[0, GREEDY_PROMPT:].tolist(),
                "sliding_window": hf.config.sliding_window, "short_ids": short,
                # log-prob of each prompt token after the ones before it (the first has none)
                "short_prompt_logprobs": [short_lp[i - 1, t].item() for i, t in enumerate(short) if i > 0],
                "short_greedy": short_out, "short_text": tok.decode(short_out, skip_special_tokens=True)}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
