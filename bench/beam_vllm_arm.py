"""vLLM's arm of `pagedserve bench beam`: `LLM.beam_search`, run by vLLM's own Python.

Standalone, as compare_vllm_arm.py (vLLM's environment has no pagedserve; the script runs
from a scratch directory). Each run prints every prompt's beams' output ids, best first,
flattened prompt by prompt.

    <vllm-python> beam_vllm_arm.py SPEC.json
"""

import json
import sys
import time


def main(spec_path: str) -> int:
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        skip_tokenizer_init=not spec["has_tokenizer"],
        seed=0,
        enable_prefix_caching=False,
    )

    def generate(prompts, max_tokens):
        params = BeamSearchParams(
            beam_width=spec["width"], max_tokens=max_tokens, ignore_eos=True, temperature=0.0
        )
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        started = time.perf_counter()
        outputs = llm.beam_search(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        beams = []
        for prompt, output in zip(prompts, outputs, strict=True):
            for sequence in output.sequences:
                beams.append(list(sequence.tokens[len(prompt) :]))
        return seconds, beams

    generate(spec["warmup_prompts"], spec["warmup_tokens"])
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            print(f"unknown command {command!r}", file=sys.stderr, flush=True)
            return 2
        seconds, outputs = generate(spec["prompts"], spec["max_tokens"])
        print(json.dumps({"seconds": seconds, "outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
