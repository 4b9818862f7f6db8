# vLLM's documented LLM.chat, parallel sampling and logprobs, with common engine arguments, as
# written for vLLM. Only the import line differs; the test substitutes a local model path.
from ratchetlm import LLM, SamplingParams

llm = LLM(model="facebook/opt-125m", max_model_len=512, gpu_memory_utilization=0.5, enforce_eager=True,
          trust_remote_code=True, seed=0)
sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=8, seed=1, logprobs=1,
                                 presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                 min_tokens=2, stop=["\n\n"])
conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)

for output in outputs:
    print(f"request {output.request_id}: {len(output.prompt_token_ids)} prompt tokens, finished={output.finished}")
    for completion in output.outputs:
        top = completion.logprobs[0][completion.token_ids[0]]
        print(f"choice {completion.index}: finish_reason={completion.finish_reason} "
              f"tokens={len(completion.token_ids)} cumulative_logprob={completion.cumulative_logprob:.3f} "
              f"first_token_rank={top.rank} text={completion.text!r}")
