"""Train an EAGLE draft head for a target model on the target's own greedy answers.

    ratchet train-eagle --out DIR [--model PATH] [--code 300] [--articles 80] [--chat 200] [--epochs 3]

1. *requests* (eagle_data.py): code edits on standard-library functions, summaries of articles
   the target wrote itself, open questions — chat-formatted as a user sends them; plus any
   ``--requests`` JSONL (benchmarks/eagle_requests.py builds one from public instruction sets);
2. *answers*: the target's greedy answers, generated with the engine (batched);
3. *features*: one teacher-forced target forward per conversation gives ``f_i`` at every position;
4. *training* (EAGLE-1's objective plus one self-fed pass): the head reads pairs
   ``(x_{j+1}, f_j)`` and is trained so that ``g_{j+1}`` matches ``f_{j+1}`` (smooth L1) and scores
   the target's own argmax at ``j + 1`` over the draft vocabulary (cross-entropy, weight
   ``--cls-weight``), at every position of every conversation.
   A second pass feeds the head its own outputs ``g`` in place of ``f`` (as every draft step after
   the first does at run time) with the same targets.

The draft vocabulary is the ``--draft-vocab`` most frequent answer tokens. The targets are exactly
the tokens a greedy verification accepts (the target's argmax), in the prompts too. Steps 1-3 are cached in ``--cache``;
training runs under bfloat16 autocast by default (``--no-bf16``: fp32) and saves a usable head at every report.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from ratchetlm import LLM, SamplingParams
from ratchetlm.decoding.speculative.eagle import EagleConfig, EagleHead
from ratchetlm.kv.sink import NullSink
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.layers.block_quant import dense_state_dict
from ratchetlm.models.llama import LlamaModel
from ratchetlm.training import eagle_data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ratchet train-eagle", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder of the head")
    p.add_argument("--model", default=None, help="target model (default: the bundled SmolLM2)")
    p.add_argument("--cache", default=None, help="file to keep/reuse the generated data (requests, answers, features)")
    p.add_argument("--code", type=int, default=300, help="code-edit requests")
    p.add_argument("--articles", type=int, default=80, help="articles to write (two requests each)")
    p.add_argument("--chat", type=int, default=200, help="open-question requests")
    p.add_argument("--requests", default=None,
                   help='JSONL of more requests, one {"prompt": ...} a line (benchmarks/eagle_requests.py builds one)')
    p.add_argument("--max-num-seqs", type=int, default=64, help="answers generated at once")
    p.add_argument("--max-tokens", type=int, default=192, help="answer length cap")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--accum", type=int, default=8, help="conversations per optimizer step")
    p.add_argument("--cls-weight", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.05, help="feature noise, relative to the feature RMS")
    p.add_argument("--time-limit-min", type=float, default=30.0, help="stop training (and save) after this long")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="train under bfloat16 autocast (fp32 master weights; ~7x faster on an AMX CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_data(llm: LLM, a: argparse.Namespace) -> dict:
    """Requests → greedy answers → teacher-forced features. Returns plain tensors (cacheable)."""
    rng = random.Random(a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)

    def chat(user: str) -> str:
        return llm.apply_chat_template([{"role": "user", "content": user}])

    articles = [o.outputs[0].text.strip()
                for o in llm.generate([chat(r) for r in eagle_data.article_requests(a.articles, rng)],
                                      SamplingParams(temperature=0.0, max_tokens=220))]
    requests = (eagle_data.code_requests(a.code, rng) + eagle_data.summary_requests(articles, 2, rng)
                + eagle_data.chat_requests(a.chat, rng) + (read_requests(Path(a.requests)) if a.requests else []))
    chats = [chat(r) for r in requests]
    outs = [o for i in range(0, len(chats), 512) for o in llm.generate(chats[i : i + 512], params)]  # under max_waiting
    convs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs if o.outputs[0].token_ids]
    model = llm.engine.model
    feats = []
    with torch.inference_mode():
        for prompt, answer in convs:
            feats.append(target_features(model, prompt + answer).half())
    return {"prompts": [p for p, _ in convs], "answers": [x for _, x in convs], "features": feats}


def read_requests(path: Path) -> list[str]:
    """The ``prompt`` of every line of a JSONL file (a missing or empty prompt is an error, not skipped)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        prompt = json.loads(line).get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{path}:{n}: each line needs a non-empty string 'prompt'")
        out.append(prompt)
    return out


def target_features(model: LlamaModel, ids: list[int]) -> torch.Tensor:  # [n, hidden] after the final norm
    pos = torch.arange(len(ids))
    batch = build_attention_batch(pos, [len(ids)], [torch.empty(0, dtype=torch.long)], [None], NullSink(), None)
    return model(torch.tensor(ids), batch)


def draft_vocabulary(answers: list[list[int]], k: int) -> torch.Tensor:
    counts = Counter(t for ans in answers for t in ans)
    return torch.tensor([t for t, _ in counts.most_common(k)], dtype=torch.long)


def head_pass(head: EagleHead, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
    """One causal pass over a whole conversation (draft indices 0..n-1)."""
    n = emb.shape[0]
    batch = build_attention_batch(torch.arange(n), [n], [torch.empty(0, dtype=torch.long)], [None], NullSink(), None)
    return head(emb, feat, batch)


def greedy_targets(prompt: list[int], answer: list[int], f: torch.Tensor, w_full: torch.Tensor,
                   remap: torch.Tensor) -> torch.Tensor:
    """[n] draft-vocab index of the target's argmax at each position (-100 where it is outside the
    draft vocabulary): exactly the token a greedy verification accepts. In the answer that argmax is
    the next answer token (the answers are the target's greedy output); in the prompt it is computed
    from the features (bfloat16 products: a near-tie may flip, which only blurs a training target)."""
    n, p = len(prompt) + len(answer), len(prompt)
    top = torch.full((n,), -1, dtype=torch.long)
    top[p - 1 : n - 1] = torch.tensor(answer)
    with torch.no_grad():
        if p > 1:
            top[: p - 1] = (f[: p - 1].bfloat16() @ w_full.T).argmax(-1)
    out = torch.full((n,), -100, dtype=torch.long)
    known = top >= 0
    out[known] = remap[top[known]]
    return out


def train(llm: LLM, data: dict, a: argparse.Namespace) -> EagleHead:
    """EAGLE-1's objective on every position of every conversation (prompt and answer): from the
    pair ``(x_{j+1}, f_j)``, ``g_{j+1}`` should match ``f_{j+1}`` and score the target's argmax
    at ``j + 1``. A held-out 5% of the conversations measures top-1 agreement as training goes."""
    torch.manual_seed(a.seed)
    target = llm.engine.model
    vocab = draft_vocabulary(data["answers"], a.draft_vocab)
    kept = set(vocab.tolist())  # (once: a set per token took minutes on 680k answer tokens)
    covered = sum(t in kept for ans in data["answers"] for t in ans)
    total = sum(map(len, data["answers"]))
    print(f"{len(data['answers'])} conversations, {total} answer tokens; draft vocab {len(vocab)} covers "
          f"{covered / total:.3f} of them", flush=True)
    head = EagleHead(EagleConfig.for_target(llm.model_config, len(vocab)))
    cast(torch.Tensor, head.draft_vocab).copy_(vocab)
    with torch.no_grad():  # warm start: the target's last layer and final norm (same shapes)
        head.layer.load_state_dict(dense_state_dict(target.layers[-1]))
        head.norm.load_state_dict(target.norm.state_dict())
    w_full = (target.lm_head if target.lm_head is not None else target.embed).dense_weight().detach()  # [V, H]
    w_bf16 = w_full.bfloat16()
    w_head = w_full[vocab]  # [K, H]
    remap = torch.full((llm.model_config.vocab_size,), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    convs = []
    for p, ans, f in zip(data["prompts"], data["answers"], data["features"], strict=True):
        if len(p) + len(ans) >= 3:
            convs.append((torch.tensor(p + ans), f.clone(), greedy_targets(p, ans, f.float(), w_bf16, remap)))
    random.Random(a.seed).shuffle(convs)
    held = convs[: max(1, min(64, len(convs) // 20))]
    convs = convs[len(held):]
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    steps = max(1, int(a.epochs * len(convs) / a.accum))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=steps, pct_start=0.05)
    t0, step, seen = time.time(), 0, 0
    log = dict(reg=0.0, cls=0.0, acc1=0.0, acc2=0.0, n=0.0)
    rng = random.Random(a.seed)
    while step < steps and time.time() - t0 < a.time_limit_min * 60:
        rng.shuffle(convs)
        for ids, f, tgt in convs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                losses, accs = conversation_loss(head, target, ids, f.float(), tgt, w_head, a.noise)
            loss = sum((1.0 if k == 0 else 0.5) * (reg + a.cls_weight * cls) for k, (reg, cls) in enumerate(losses))
            (loss / a.accum).backward()
            log["reg"] += losses[0][0].item()
            log["cls"] += losses[0][1].item()
            log["acc1"] += accs[0]
            log["acc2"] += accs[1]
            log["n"] += 1
            seen += 1
            if seen % a.accum:
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 100 == 0 or step == steps:
                m = max(1.0, log["n"])
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                    val = [conversation_loss(head, target, ids, f.float(), tgt, w_head, 0.0)[1] for ids, f, tgt in held]
                print(f"step {step}/{steps} {time.time() - t0:.0f}s reg {log['reg'] / m:.4f} cls {log['cls'] / m:.3f} "
                      f"top1 {log['acc1'] / m:.3f} self-fed {log['acc2'] / m:.3f} | held-out top1 "
                      f"{sum(v[0] for v in val) / len(val):.3f} self-fed {sum(v[1] for v in val) / len(val):.3f}",
                      flush=True)
                log = dict(reg=0.0, cls=0.0, acc1=0.0, acc2=0.0, n=0.0)
                copy.deepcopy(head).half().save(a.out)  # a usable head at every report (training may be cut)
            if step >= steps or time.time() - t0 > a.time_limit_min * 60:
                break
    return head.eval()


Losses = list[tuple[torch.Tensor, torch.Tensor]]  # (feature regression, token cross-entropy) per pass


def conversation_loss(head: EagleHead, target: LlamaModel, ids: torch.Tensor, f: torch.Tensor, tgt: torch.Tensor,
                      w_head: torch.Tensor, noise: float) -> tuple[Losses, list[float]]:
    """Two passes over one conversation (``ids`` [n], features ``f`` [n, H], targets ``tgt`` [n]):
    pass 1 reads the true (noised) features, pass 2 the head's own outputs of pass 1 — as every
    draft step after the first does at run time. Returns (reg, cls) per pass and top-1 per pass."""
    emb = target.embed(ids[1:]).detach()  # [n-1, H]: x_{j+1}
    fin = f[:-1] * (1 + noise * torch.randn_like(f[:-1])) if noise else f[:-1]  # f_j
    g1 = head_pass(head, emb, fin)
    g2 = head_pass(head, emb, torch.cat([fin[:1], g1[:-1]]))  # g_j in place of f_j for j >= 1
    out, accs = [], []
    for g in (g1, g2):
        logits = g @ w_head.T  # [n-1, K]
        t = tgt[1:]  # the target's argmax at j + 1
        out.append((F.smooth_l1_loss(g, f[1:]), F.cross_entropy(logits, t, ignore_index=-100)))
        with torch.no_grad():
            accs.append((logits.argmax(-1) == t)[t >= 0].float().mean().item())
    return out, accs


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, dtype="float32", max_num_seqs=a.max_num_seqs, progress=True)
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.is_file():
        data = torch.load(cache)
    else:
        data = build_data(llm, a)
        if cache is not None:
            torch.save(data, cache)
    head = train(llm, data, a)
    head.half().save(a.out)
    print(f"saved the EAGLE head to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
