# LLM.beam_search as vLLM's offline API has it (BeamSearchParams from vllm.sampling_params).
from vllm import LLM, EngineArgs
from vllm.sampling_params import BeamSearchParams
from vllm.utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
llm = LLM(**vars(parser.parse_args()))

params = BeamSearchParams(beam_width=3, max_tokens=6)
outputs = llm.beam_search([{"prompt": "The capital of France is"}, {"prompt": "Hello"}], params)
for output in outputs:
    for sequence in output.sequences:
        print(f"{sequence.text!r}: cumulative logprob {sequence.cum_logprob:.3f}")
