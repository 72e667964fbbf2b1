# Sampling parameters and logprobs as vLLM's offline docs use them: per-prompt params, a
# seeded sample, greedy with the top-5 logprobs of each token and of the prompt.
from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
llm = LLM(**vars(parser.parse_args()))

greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5)
seeded = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=8, stop=["\n\n"])
outputs = llm.generate(["The capital of France is", "Once upon a time"], [greedy, seeded])
completion = outputs[0].outputs[0]
for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
    top = max(logprobs.values(), key=lambda lp: lp.logprob)
    print(f"token {token_id}: logprob {logprobs[token_id].logprob:.3f}, "
          f"rank {logprobs[token_id].rank}, most likely {top.decoded_token!r}")
print(f"prompt logprobs: {len(outputs[0].prompt_logprobs)} positions, the first is "
      f"{outputs[0].prompt_logprobs[0]}")
print(f"cumulative logprob: {completion.cumulative_logprob:.3f}")
print(f"seeded sample: {outputs[1].outputs[0].text!r} ({outputs[1].outputs[0].finish_reason})")
