"""Greedy agreement of mrv2 (`quantization="gguf"`, the file's blocks as stored) with llama.cpp
on the same GGUF file, by hand (llama-cpp-python: the `peers` extra):

    python bench/gguf_greedy_agreement.py FILE.gguf [--prompts 8] [--tokens 32]

Random prompts of 32 token ids (seed 0), greedy, EOS ignored; prints how many completions are
equal, and per position how many agree through it. Random-weight checkpoints have flat logits,
so near-ties make the two engines part sooner than on a trained model.
"""

from __future__ import annotations

import argparse
import random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from mrv2 import LLM, SamplingParams
    from mrv2.entrypoints.bench.sweep_engines import (EngineSpec, LlamaCppEngine, SweepSetup,
                                                      read_sweep_model)

    model = read_sweep_model(args.path)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, model.vocab_size) for _ in range(32)]
               for _ in range(args.prompts)]
    llm = LLM(args.path, quantization="gguf", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.shutdown()
    # The sweep's llama.cpp wrapper: every prompt one sequence, greedy argmax, EOS ignored.
    setup = SweepSetup(max_batch=len(prompts), input_len=32, output_len=args.tokens, seed=0,
                       threads=2)
    peer = LlamaCppEngine(EngineSpec("llama.cpp", "llama.cpp", "gguf"), model, setup)
    theirs = peer.generate(prompts, args.tokens)
    peer.shutdown()
    equal = sum(a == b for a, b in zip(ours, theirs))
    print(f"{args.path}: {equal} of {len(prompts)} completions equal")
    through = [sum(a[:i + 1] == b[:i + 1] for a, b in zip(ours, theirs))
               for i in range(args.tokens)]
    print("agreeing through position:", " ".join(map(str, through)))


if __name__ == "__main__":
    main()
