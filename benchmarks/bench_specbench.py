"""Spec-Bench on a CPU: speculative decoding against plain AR decoding in the same numerics mode, per group.

Spec-Bench (hemingkx/Spec-Bench, Apache-2.0; the question file and its license are in
benchmarks/data/spec_bench/) holds 480 questions in six groups of 80: multi-turn conversation (MT-bench:
the first turn, then the second turn after the model's own first answer), translation, summarization,
question answering, mathematical reasoning and retrieval-augmented generation. ``--per-group N`` questions
of each group (a seeded sample, the same for every config) run greedy for ``--max-tokens`` tokens at
batch 1, in one process, each case through plain AR and every speculative config on the same model,
interleaved: by default one engine step of each in turn (``--interleave step``, lockstep; each engine is
timed by its own steps, so load drift on a shared machine hits all alike even within a case), or each
case through one engine after the other (``--interleave run``); engines are kept across cases, as a
server keeps them, after one warm-up case each.

Per group and config: **MAL** (mean accepted length: tokens committed per target forward after the first
token, 1.00 for AR; Spec-Bench's "mean accepted tokens"; vLLM's counter in decoding/speculative/stats.py
counts only steps that carried a draft, so it reads higher), **speed-up** (total tokens over total
seconds, request to last token, against AR's on the same cases), **Spec-Bench speed-up** (the benchmark's
own definition, its evaluation/speed.py: the mean over questions of tokens/s, both MT-bench turns counted
as one question, over AR's mean), **greedy identity** (cases whose tokens
equal AR's), **decode speed-up** (the same after the first token: no prefill) and **step cost** (a decode
step's time in AR decode steps: decode speed-up = MAL / step cost). Per group also AR's time before its
first token (the prompt's prefill): an end-to-end speed-up can be at most 1 / that share. Overall: the
same aggregate over every case, and the median of the per-case speed-ups. ``--llamacpp``: the same token
ids through llama-cpp-python on the same file and threads, plain and with its prompt-lookup draft
(``LlamaPromptLookupDecoding``); those columns compare decode-phase tokens/s (after the first token) of
the config with llama.cpp's. ``--batch N`` then runs the sample's first turns N different prompts at a
time through AR and every config (interleaved the same way): speed-up against AR and greedy identity at that
batch.

    python benchmarks/bench_specbench.py [--model FILE.gguf] [--numerics auto] [--configs default ngram]
        [--per-group 3] [--max-tokens 128] [--chat | --no-chat] [--llamacpp] [--threads 2] [--clock cpu] [--batch 8]

``--configs``: ``default`` (the ``speculative`` strategy's default options) or any registered proposer
name (``ngram``, ``eagle``, ...: decoding/speculative/proposers.py), optionally with options,
``ngram:depth=4,num_candidates=3``. ``--chat`` (the default where the file has a chat template) formats
each turn with it; ``--no-chat`` sends plain text (base models such as Gemma 3 270M).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ratchetlm import LLM  # noqa: E402
from ratchetlm.engine.config import EngineConfig  # noqa: E402
from ratchetlm.engine.llm_engine import LLMEngine  # noqa: E402
from ratchetlm.models.gguf_file import GGUFFile  # noqa: E402
from ratchetlm.models.loader import resolve  # noqa: E402
from ratchetlm.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = Path(__file__).with_name("data") / "spec_bench" / "question.jsonl"
# Spec-Bench's six groups: its categories, MT-bench's eight folded into one multi-turn group
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SINGLE = {"translation", "summarization", "qa", "math_reasoning", "rag"}


def load_questions(path: Path = QUESTIONS) -> dict[str, list[dict[str, Any]]]:
    """Group -> questions (``turns``: one, or two for mt_bench), in file order."""
    out: dict[str, list[dict[str, Any]]] = {g: [] for g in GROUPS}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        out[q["category"] if q["category"] in SINGLE else "mt_bench"].append(q)
    return out


def draw_sample(questions: dict[str, list[dict[str, Any]]], per_group: int, seed: int, groups: list[str]
                ) -> dict[str, list[dict[str, Any]]]:
    """``per_group`` seeded questions of each of ``groups``: drawn for every group in file order, then
    chosen, so that ``--groups`` picks the same questions as a run over all six."""
    rng = random.Random(seed)
    drawn = {g: rng.sample(questions[g], min(per_group, len(questions[g]))) for g in GROUPS}
    return {g: drawn[g] for g in groups}


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:key=value,...]`` -> (label, speculative options); the options are validated by building
    the strategy's config (an unknown proposer or option is an error naming it)."""
    from ratchetlm.decoding.speculative.config import SpecConfig

    name, _, rest = text.partition(":")
    opts: dict[str, Any] = {} if name == "default" else {"method": name}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"config {text!r}: options are key=value, got {item!r}")
        opts[key] = _value(value)
    SpecConfig.from_options(opts)
    return text, opts


def _value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


@dataclass
class Run:
    """One case through one engine."""

    tokens: list[int]
    seconds: float  # request to last token
    decode_seconds: float  # first token to last token
    decode_forwards: int  # target forwards after the one that made the first token

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - 1


# --clock cpu: this process's CPU seconds instead of wall seconds. With one thread per engine on a machine
# shared with busy neighbours, wall time measures the neighbours (a case's AR tok/s varied 2.4x in one run
# at load 8); CPU time still counts cache and memory-bandwidth contention, so interleaving stays.
CLOCK = time.perf_counter


def run_case(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> Run:
    t = CLOCK()
    rid = eng.add_request(prompt, params)
    seq = eng.seqs[rid]
    t_first, f_first = None, 0
    while eng.has_unfinished():
        eng.step()
        if t_first is None and seq.output_ids:
            t_first, f_first = CLOCK(), eng.runner.num_forwards
    end = CLOCK()
    assert t_first is not None
    return Run(list(seq.output_ids), end - t, end - t_first, eng.runner.num_forwards - f_first)


@dataclass
class Lockstep:
    """One engine's part of a :func:`lockstep` run."""

    runs: list[Run]  # per request: seconds of this engine's steps from the start to the request's end
    seconds: float  # all of this engine's steps
    decode_seconds: float  # its steps with no prompt computed or waiting (the decode phase)
    decode_tokens: int  # tokens those steps committed


def lockstep(engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams) -> dict[str, Lockstep]:
    """``prompts`` (at once) through every engine, one step of each engine in turn until all are done: each
    engine is timed by its own steps only, so load on a shared machine that changes within a run (seconds)
    hits every engine alike. (Interleaving whole runs left identical AR engines 0.8-1.2x apart per batch of
    8 at load 3-4 by CPU time: 2026-11-29, docs/benchmarks.md.)"""
    ids = {label: [e.add_request(p, params) for p in prompts] for label, e in engines.items()}
    spent = dict.fromkeys(engines, 0.0)
    dsecs, dtoks = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    first: dict[str, dict[int, tuple[float, int]]] = {k: {} for k in engines}  # seq id -> (time, forwards)
    end: dict[str, dict[int, float]] = {k: {} for k in engines}
    live = [k for k, e in engines.items() if e.has_unfinished()]
    while live:
        for label in live:
            eng = engines[label]
            prompt = bool(eng.scheduler.waiting) or any(eng.scheduler.prefilling(s) for s in eng.scheduler.running)
            t = CLOCK()
            outs = eng.step()
            dt = CLOCK() - t
            spent[label] += dt
            if not prompt:
                dsecs[label] += dt
                dtoks[label] += sum(len(o.new_token_ids) for o in outs)
            for o in outs:
                if o.new_token_ids and o.seq_id not in first[label]:
                    first[label][o.seq_id] = (spent[label], eng.runner.num_forwards)
                if o.finished:
                    end[label][o.seq_id] = spent[label]
        live = [k for k in live if engines[k].has_unfinished()]
    out = {}
    for label, eng in engines.items():
        runs = []
        for i in ids[label]:
            seq = eng.release(i)
            assert seq is not None and i in first[label], "a request ended without a token"
            t_first, f_first = first[label][i]
            runs.append(Run(list(seq.output_ids), end[label][i], end[label][i] - t_first,
                            eng.runner.num_forwards - f_first if len(ids[label]) == 1 else 0))
        out[label] = Lockstep(runs, spent[label], dsecs[label], dtoks[label])
    return out


class LlamaCpp:
    """llama-cpp-python on the same file and threads, greedy, on the same token ids; ``pld``: its
    prompt-lookup draft (``LlamaPromptLookupDecoding``; ``num_pred_tokens`` 2, its README's advice for a
    CPU-only machine)."""

    def __init__(self, path: str, threads: int, ctx: int, pld: bool, pld_tokens: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=pld_tokens) if pld else None
        # logits_all with the draft: llama-cpp-python forces it on then but sizes its logits buffer from the
        # argument (n_batch rows), which overflows once a draft is verified past position n_batch (0.3.36)
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                                   draft_model=draft, logits_all=pld, verbose=False)
        self.eos = self.llm.token_eos()

    def run(self, prompt: list[int], max_tokens: int) -> Run:
        t = CLOCK()
        out: list[int] = []
        t_first = t
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if not out:
                t_first = CLOCK()
            out.append(int(tok))
            if tok == self.eos or len(out) >= max_tokens:
                break
        end = CLOCK()
        return Run(out, end - t, end - t_first, 0)


@dataclass
class Case:
    group: str
    qid: int
    turn: int
    prompt: list[int]
    runs: dict[str, Run] = field(default_factory=dict)  # engine label -> its run


class Prompts:
    """Spec-Bench turns as token ids: the chat template (``chat``) or plain text, with the file's BOS
    where the GGUF asks for one (``tokenizer.ggml.add_bos_token``) and the text does not start with it."""

    def __init__(self, llm: LLM, chat: bool, bos: int | None) -> None:
        self.llm, self.chat, self.bos = llm, chat, bos

    def ids(self, turns: list[str], answers: list[str]) -> list[int]:
        if self.chat:
            msgs: list[dict[str, Any]] = []
            for i, q in enumerate(turns):
                msgs.append({"role": "user", "content": q})
                if i < len(answers):
                    msgs.append({"role": "assistant", "content": answers[i]})
            ids = self.llm.tokenize(self.llm.apply_chat_template(msgs), add_special_tokens=False)
        else:
            text = "".join(f"{q}\n\n{answers[i]}\n\n" if i < len(answers) else f"{q}\n\n"
                           for i, q in enumerate(turns))
            ids = self.llm.tokenize(text)
        return ids if self.bos is None or ids[:1] == [self.bos] else [self.bos, *ids]


def make_engine(llm: LLM, opts: dict[str, Any] | None) -> LLMEngine:
    """An engine on ``llm``'s loaded model: plain decoding (``opts`` None) or ``speculative`` with ``opts``, in
    ``llm``'s numerics, with its KV pools touched."""
    cfg = EngineConfig(dtype="float32", decoding="speculative" if opts is not None else "autoregressive",
                       decoding_options=opts or {}, kv_cache_blocks=1024, progress=False,
                       numerics=llm.config.numerics)
    eng = LLMEngine(cfg, llm.engine.model, llm.model_config, tokenizer=llm.tokenizer)
    # the KV pools are backed page by page on first write (memory/huge_pages.py): touched here, a new 2 MB
    # region's first write (30 layers' worth of huge pages, 20-400 ms of one core on a busy VM) is not
    # timed against whichever engine's block reservations reach it first (as in a server that has run)
    for t in getattr(eng.runner.cache, "stacked", {}).values():
        t.zero_()
    return eng


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--numerics", default="auto", choices=("auto", "exact", "int8", "int16"))
    ap.add_argument("--configs", nargs="+", default=["default"],
                    help="speculative configs: default | PROPOSER[:key=value,...] (each against plain AR)")
    ap.add_argument("--per-group", type=int, default=3, help="questions per group (a seeded sample)")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS)
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="chat template (default: where the model has one) or plain prompts (--no-chat)")
    ap.add_argument("--llamacpp", action="store_true", help="also llama-cpp-python, plain and prompt lookup")
    ap.add_argument("--pld-tokens", type=int, default=2, help="LlamaPromptLookupDecoding's num_pred_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1,
                    help="N > 1: also the sample's first turns N at a time (different prompts batched), each "
                         "config against AR on the same batches")
    ap.add_argument("--batch-only", action="store_true", help="with --batch: skip the batch-1 cases")
    ap.add_argument("--interleave", choices=("step", "run"), default="step",
                    help="step: every engine one step in turn on the same requests (lockstep; each timed by its "
                         "own steps); run: each case or batch through one engine after the other")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time runs by wall clock or by this process's CPU seconds (a busy shared machine; "
                         "meaningful with --threads 1)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints its tables; returns {"cases": [...], "rows": {(config, group): row}, ...}."""
    a = build_parser().parse_args(argv)
    if a.per_group < 1 or a.max_tokens < 2 or a.batch < 1:
        raise SystemExit("--per-group and --batch must be >= 1 and --max-tokens >= 2")
    if a.batch_only and a.batch < 2:
        raise SystemExit("--batch-only needs --batch N with N >= 2")
    try:
        configs = dict(parse_config(c) for c in a.configs)
    except ValueError as e:
        raise SystemExit(f"--configs: {e}") from None
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    llm = LLM(a.model, progress=False, dtype="float32", numerics=a.numerics)
    path = str(resolve(a.model).path)
    reader = GGUFFile(path) if path.endswith(".gguf") else None
    chat = a.chat if a.chat is not None else bool(reader and reader.get("tokenizer.chat_template"))
    bos = reader.get("tokenizer.ggml.bos_token_id") if reader and reader.get("tokenizer.ggml.add_bos_token") else None
    prompts = Prompts(llm, chat, bos)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)

    engines: dict[str, Any] = {"AR": make_engine(llm, None), **{k: make_engine(llm, o) for k, o in configs.items()}}
    questions = load_questions()
    sample = draw_sample(questions, a.per_group, a.seed, a.groups)
    # llama.cpp's context: the longest case (every turn, each earlier answer at most max_tokens) and margin;
    # no larger (with a draft model llama-cpp-python keeps logits for every context position: ctx x vocab)
    ctx = 64 + max(len(prompts.ids(q["turns"], [""] * (len(q["turns"]) - 1))) + len(q["turns"]) * a.max_tokens
                   for qs in sample.values() for q in qs)
    if a.llamacpp:
        try:
            engines["llama.cpp"] = LlamaCpp(path, a.threads, ctx, False, a.pld_tokens)
            engines["llama.cpp PLD"] = LlamaCpp(path, a.threads, ctx, True, a.pld_tokens)
        except ImportError:
            print("llama-cpp-python is not installed (pip install 'ratchetlm[llamacpp]'): no llama.cpp columns")

    def go(label: str, ids: list[int]) -> Run:
        e = engines[label]
        return e.run(ids, a.max_tokens) if isinstance(e, LlamaCpp) else run_case(e, ids, params)

    ours = {k: e for k, e in engines.items() if isinstance(e, LLMEngine)}
    warm = prompts.ids([questions["qa"][-1]["turns"][0]], [])  # a question no sample of size < 80 takes first
    for label in engines:
        go(label, warm[:64])
    form = "chat template" if chat else "plain prompts"
    print(f"Spec-Bench, {Path(path).name}, numerics {llm.config.numerics}, {form}, batch 1, greedy, max "
          f"{a.max_tokens} tokens, {a.threads} threads, {a.clock} clock, {a.per_group} per group, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    cases: list[Case] = []
    for g, qs in ({} if a.batch_only else sample).items():
        for q in qs:
            answers: list[str] = []
            for turn in range(len(q["turns"])):
                case = Case(g, q["question_id"], turn + 1, prompts.ids(q["turns"][: turn + 1], answers))
                if a.interleave == "step":
                    case.runs.update((k, v.runs[0]) for k, v in lockstep(ours, [case.prompt], params).items())
                for label in engines:
                    if label not in case.runs:
                        case.runs[label] = go(label, case.prompt)
                cases.append(case)
                ar = case.runs["AR"]
                cells = "  ".join(f"{k} {len(r.tokens) / r.seconds:.1f}" for k, r in case.runs.items())
                mals = "  ".join(f"{k} MAL {r.decode_tokens / max(r.decode_forwards, 1):.2f}"
                                 f"{'' if r.tokens == ar.tokens else ' (differs)'}"
                                 for k, r in case.runs.items() if k in configs)
                # seconds to the first token (the prompt's prefill): the same work in every engine
                firsts = "  ".join(f"{k} {r.seconds - r.decode_seconds:.2f}" for k, r in case.runs.items())
                print(f"  {g} q{q['question_id']} turn {turn + 1}: {len(case.prompt)} prompt tokens, "
                      f"{len(ar.tokens)} out, tok/s {cells}; {mals}; first token s {firsts}", flush=True)
                answers.append(llm.tokenizer.decode(ar.tokens, skip_special_tokens=True))
    rows = report(cases, list(configs), a.groups, "llama.cpp" in engines) if cases else {}
    batched = None
    if a.batch > 1:
        firsts = [prompts.ids([q["turns"][0]], []) for qs in sample.values() for q in qs]
        random.Random(a.seed).shuffle(firsts)  # mixed groups in every batch
        batches = [firsts[i : i + a.batch] for i in range(0, len(firsts) - a.batch + 1, a.batch)]
        batched = run_batches(ours, batches, params, a.interleave == "step")
    print_prices(ours)
    return {"cases": cases, "rows": rows, "numerics": llm.config.numerics, "chat": chat, "llm": llm,
            "batched": batched}


def print_prices(engines: dict[str, LLMEngine]) -> None:
    """Each config's learnt draft price per batch size (decoding/speculative/draft_price.py: a draft of the
    curve's price E costs factor·E + fixed) and the steps its ledger made plain, from its metrics."""
    for label, eng in engines.items():
        m = eng.strategy.metrics()
        sizes = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("spec_decode_draft_price_factor_batch_"))
        if sizes:
            cells = ", ".join(f"{b}: {m[f'spec_decode_draft_price_factor_batch_{b}']:.2f}"
                              f" + {m[f'spec_decode_draft_price_fixed_batch_{b}']:.2f}" for b in sizes)
            print(f"  {label} draft price per batch size (factor + fixed): {cells}; "
                  f"ledger plain steps {m.get('spec_decode_ledger_plain_steps', 0):.0f}, idle-gate plain steps "
                  f"{m.get('spec_decode_idle_plain_steps', 0):.0f}")


def run_batches(engines: dict[str, LLMEngine], batches: list[list[list[int]]], params: SamplingParams,
                by_step: bool = True) -> dict[str, dict[str, float]]:
    """Each batch of different prompts through every engine in turn (interleaved): per config its
    speed-up against AR (total tokens over total seconds, request to last token), the same over the
    decode phase alone (steps in which no prompt was computed or waiting: the eight prompts' prefill,
    most of a batch's time with Spec-Bench's long prompts, is the same work for every engine and its
    time varied by up to ~30% between engines on a busy machine) and how many requests' tokens equal AR's."""
    secs = dict.fromkeys(engines, 0.0)
    toks = dict.fromkeys(engines, 0)
    same = dict.fromkeys(engines, 0)
    dsecs = dict.fromkeys(engines, 0.0)  # decode-phase seconds and tokens
    dtoks = dict.fromkeys(engines, 0)
    for batch in batches:
        ref: list[list[int]] = []
        if by_step:  # every engine one step in turn (lockstep)
            for label, r in lockstep(engines, batch, params).items():
                secs[label] += r.seconds
                dsecs[label] += r.decode_seconds
                dtoks[label] += r.decode_tokens
                outs = [run.tokens for run in r.runs]
                ref = ref or outs
                toks[label] += sum(map(len, outs))
                same[label] += sum(o == x for o, x in zip(outs, ref, strict=True))
            continue
        for label, eng in engines.items():
            t = CLOCK()
            ids = [eng.add_request(p, params) for p in batch]
            while eng.has_unfinished():
                prompt = bool(eng.scheduler.waiting) or any(eng.scheduler.prefilling(s) for s in eng.scheduler.running)
                t_step = CLOCK()
                outs_ = eng.step()
                if not prompt:
                    dsecs[label] += CLOCK() - t_step
                    dtoks[label] += sum(len(o.new_token_ids) for o in outs_)
            secs[label] += CLOCK() - t
            outs = [list(eng.seqs[i].output_ids) for i in ids]
            for i in ids:
                eng.release(i)
            ref = ref or outs
            toks[label] += sum(map(len, outs))
            same[label] += sum(o == r for o, r in zip(outs, ref, strict=True))
    n = sum(map(len, batches))
    ar = toks["AR"] / secs["AR"]
    print(f"\nbatched: {len(batches)} batches of {len(batches[0])} different prompts (first turns), tok/s AR {ar:.1f}")
    out = {}
    ar_decode = dtoks["AR"] / max(dsecs["AR"], 1e-9)
    for label in engines:
        if label != "AR":
            out[label] = {"speedup": toks[label] / secs[label] / ar, "same": same[label], "n": n,
                          "decode_speedup": dtoks[label] / max(dsecs[label], 1e-9) / ar_decode}
            print(f"  {label}: {out[label]['speedup']:.2f}x AR (decode phase {out[label]['decode_speedup']:.2f}x), "
                  f"identical {same[label]}/{n}")
    return out


def _agg(cases: list[Case], label: str) -> dict[str, float]:
    ar_t = sum(c.runs["AR"].seconds for c in cases)
    tok = sum(len(c.runs[label].tokens) for c in cases)
    fwd = sum(c.runs[label].decode_forwards for c in cases)
    dec = sum(c.runs[label].decode_tokens for c in cases)
    ar_tok = sum(len(c.runs["AR"].tokens) for c in cases)
    per_case = sorted((len(c.runs[label].tokens) / c.runs[label].seconds)
                      / (len(c.runs["AR"].tokens) / c.runs["AR"].seconds) for c in cases)
    return {"mal": dec / fwd if fwd else 1.0,
            "speedup": (tok / sum(c.runs[label].seconds for c in cases)) / (ar_tok / ar_t),
            "specbench": specbench_speedup(cases, label),
            "median": statistics.median(per_case),
            # the spread of the per-case ratios: the 10th percentile (nearest rank), the lowest, how many lose
            "p10": per_case[(len(per_case) - 1) // 10], "lowest": per_case[0],
            "below": sum(r < 1.0 for r in per_case),
            "same": sum(c.runs[label].tokens == c.runs["AR"].tokens for c in cases), "n": len(cases),
            "decode_tps": dec / sum(c.runs[label].decode_seconds for c in cases),
            # the decode phase alone (after the first token; no prefill): tok/s against AR's, and a step's
            # time in AR steps (the verify forward, its tree and the strategy's Python: what MAL must beat)
            "decode_speedup": (dec / sum(c.runs[label].decode_seconds for c in cases)) / _decode_tps(cases, "AR"),
            "step_cost": _step_seconds(cases, label) / _step_seconds(cases, "AR")}


def specbench_speedup(cases: list[Case], label: str) -> float:
    """Spec-Bench's own speed-up (its evaluation/speed.py): per question, tokens over seconds summed over its
    turns (MT-bench: both), then the mean of those speeds against AR's mean. Each question weighs the same in
    tokens/s, where the total-time speed-up weighs each by its seconds (a long prompt's prefill counts more)."""
    def mean_speed(lab: str) -> float:
        per_q: dict[tuple[str, int], list[float]] = {}
        for c in cases:
            tot = per_q.setdefault((c.group, c.qid), [0.0, 0.0])
            tot[0] += len(c.runs[lab].tokens)
            tot[1] += c.runs[lab].seconds
        return statistics.mean(t / s for t, s in per_q.values())
    return mean_speed(label) / mean_speed("AR")


def _step_seconds(cases: list[Case], label: str) -> float:
    return sum(c.runs[label].decode_seconds for c in cases) / max(sum(c.runs[label].decode_forwards for c in cases), 1)


def _decode_tps(cases: list[Case], label: str) -> float:
    return sum(c.runs[label].decode_tokens for c in cases) / sum(c.runs[label].decode_seconds for c in cases)


def report(cases: list[Case], configs: list[str], groups: list[str], llamacpp: bool) -> dict[tuple[str, str], Any]:
    rows: dict[tuple[str, str], Any] = {}
    for name in configs:
        print(f"\n{name} vs AR (same numerics; speed-up: total tokens / total time; Spec-Bench: its own "
              "speed-up, mean per-question tokens/s over AR's; identical: greedy tokens == AR's)")
        head = ("| group | cases | MAL | speed-up | Spec-Bench speed-up | median per case | identical "
                "| decode speed-up | step cost |")
        sep = "|---|---|---|---|---|---|---|---|---|"
        if llamacpp:
            head += " decode tok/s | vs llama.cpp | vs llama.cpp PLD |"
            sep += "---|---|---|"
        print(head + "\n" + sep)
        for g in [*groups, "overall"]:
            sel = [c for c in cases if g in ("overall", c.group)]
            if not sel:
                continue
            r = rows[(name, g)] = _agg(sel, name)
            line = (f"| {g} | {r['n']} | {r['mal']:.2f} | {r['speedup']:.2f}x | {r['specbench']:.2f}x | "
                    f"{r['median']:.2f}x | {r['same']}/{r['n']} | {r['decode_speedup']:.2f}x | {r['step_cost']:.2f} |")
            if llamacpp:
                lp, lpld = _decode_tps(sel, "llama.cpp"), _decode_tps(sel, "llama.cpp PLD")
                r["vs_llamacpp"], r["vs_llamacpp_pld"] = r["decode_tps"] / lp, r["decode_tps"] / lpld
                line += f" {r['decode_tps']:.1f} | {r['vs_llamacpp']:.2f}x | {r['vs_llamacpp_pld']:.2f}x |"
            print(line)
        r = rows[(name, "overall")]
        print(f"per case: median {r['median']:.2f}x, 10th percentile {r['p10']:.2f}x, lowest {r['lowest']:.2f}x; "
              f"{r['below']} of {r['n']} below 1.0x")
    if llamacpp:
        tps = ", ".join(f"{k} {_decode_tps(cases, k):.1f}" for k in ("AR", "llama.cpp", "llama.cpp PLD"))
        print(f"\ndecode tok/s overall: {tps}")
    print("\nAR's time in prefill (and its first token): the end-to-end speed-up a free decode phase would reach")
    for g in [*groups, "overall"]:
        sel = [c for c in cases if g in ("overall", c.group)]
        if sel:
            share = prefill_share(sel)
            rows[("AR", g)] = {"prefill_share": share}
            print(f"  {g}: {share:.0%} of AR's time, ceiling {1 / share if share else float('inf'):.2f}x")
    return rows


def prefill_share(cases: list[Case]) -> float:
    """AR's time before its first token over its total time, summed over ``cases`` (prefill is the same
    work for every engine, so an end-to-end speed-up is at most 1 / this share)."""
    runs = [c.runs["AR"] for c in cases]
    return sum(r.seconds - r.decode_seconds for r in runs) / sum(r.seconds for r in runs)


if __name__ == "__main__":
    main()
