"""Our arm of `pagedserve bench beam`'s throughput part: beam search inside the offline `LLM`,
in a child process of its own (the `compare_protocol` lines; each run's outputs are every
prompt's beams, best first, flattened prompt by prompt).

python -m pagedserve.bench.beam_ours_arm SPEC.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from pagedserve.bench.compare_protocol import QUIT, READY, RUN


def main(argv: Sequence[str]) -> int:
    from pagedserve import LLM, SamplingParams

    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    llm = LLM(
        spec["model_dir"],
        dtype=spec["dtype"],
        enable_prefix_caching=False,
        kv_cache_bytes=spec["kv_cache_gib"] << 30,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(
            n=spec["width"],
            use_beam_search=True,
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        return seconds, [list(c.token_ids) for o in outputs for c in o.outputs]

    generate(spec["warmup_prompts"], spec["warmup_tokens"])
    print(READY, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == QUIT:
            break
        if command != RUN:
            print(f"unknown command {command!r}", file=sys.stderr, flush=True)
            return 2
        seconds, outputs = generate(spec["prompts"], spec["max_tokens"])
        print(json.dumps({"seconds": seconds, "outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
