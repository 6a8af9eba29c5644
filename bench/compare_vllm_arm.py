"""The vLLM arm of `pagedserve bench compare`, run by vLLM's own Python (see compare_protocol).

Standalone on purpose: vLLM's virtual environment does not have pagedserve, and the script is
copied to a scratch directory before it runs, so that nothing of this checkout (its top-level
``kernels`` folder shadows a package transformers probes) is on ``sys.path``.

    <vllm-python> compare_vllm_arm.py SPEC.json
"""

import json
import sys
import time


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        skip_tokenizer_init=not spec["has_tokenizer"],
        seed=0,
        enable_prefix_caching=False,  # each timed run repeats the prompts: no hits from the last
    )

    def generate(prompts, max_tokens):
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

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


if __name__ == "__main__":  # vLLM's engine starts processes that import this module
    sys.exit(main(sys.argv[1]))
