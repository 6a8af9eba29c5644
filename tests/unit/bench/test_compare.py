"""`pagedserve bench compare`: its prompts, its arm protocol and a real run of our arm."""

import json
import subprocess
import sys

import pytest

from pagedserve.bench.compare_arm import Arm, ArmFailed, child_env
from pagedserve.bench.compare_workload import random_prompts, text_prompts


def test_text_prompts_are_windows_of_real_text_with_drawn_lengths():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731 - a character "tokenizer"
    prompts = text_prompts(encode, 20, 16, 300, seed=0)
    assert prompts == text_prompts(encode, 20, 16, 300, seed=0)  # the seed fixes them
    assert prompts != text_prompts(encode, 20, 16, 300, seed=1)
    assert all(16 <= len(p) <= 300 for p in prompts)
    words = "".join(map(chr, max(prompts, key=len)))
    assert sum(c.isalpha() for c in words) > len(words) / 2, words  # prose, not noise


def test_random_prompts_use_only_the_allowed_ids():
    prompts = random_prompts(10, 5, 9, range(3, 7), seed=0)
    assert all(5 <= len(p) <= 9 and set(p) <= {3, 4, 5, 6} for p in prompts)


def test_an_arm_that_dies_says_why_with_its_log(tmp_path):
    code = "import sys; print('loading', file=sys.stderr); sys.exit(3)"
    arm = Arm("peer", [sys.executable, "-c", code], str(tmp_path), child_env({}),
              str(tmp_path / "peer.log"))  # fmt: skip
    arm.start()
    with pytest.raises(ArmFailed, match=r"(?s)peer arm exited \(code 3\).*loading"):
        arm.wait_ready()


@pytest.mark.slow  # the real command in a subprocess: ~25-45 s on a 2-core machine
def test_our_arm_runs_the_protocol_end_to_end(tmp_path):
    """The real command on tiny-llama, our arm alone (vLLM is not installed here)."""
    out = tmp_path / "compare.json"
    args = ["--model", "tiny-llama", "--num-prompts", "3", "--min-len", "4", "--max-len", "12"]
    args += ["--max-tokens", "5", "--repeats", "2", "--json", str(out), "--vllm-python", ""]
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "compare", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env({"PAGEDSERVE_VLLM_PYTHON": ""}),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    (ours,) = result["sides"]
    assert ours["name"] == "ours" and len(ours["tokens_per_s"]) == 2
    assert result["agreement"] == {"ours=hf": 3} and result["stable"] == {"ours": True}
    assert "vLLM left out" in run.stdout


def test_our_arm_threads_go_to_its_environment_only_when_chosen():
    from pagedserve.bench.compare import ours_threads_env

    assert ours_threads_env(None) == {}
    assert ours_threads_env(1) == {"OMP_NUM_THREADS": "1"}
