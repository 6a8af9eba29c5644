"""Tests for `pagedserve kv-calc` (pagedserve.bench.kv_calc), run through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import main

SEED_ARGS = ["kv-calc", "--lengths", "37,91,128,201,511", "--block-sizes", "16,32"]
SEED_ARGS += ["--max-len", "512"]
LLAMA_8B = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16"]
CONSOLE_SCRIPT = Path(sys.executable).with_name("pagedserve")
ERROR_PREFIX = "pagedserve kv-calc: error:"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``pagedserve argv``, whether it returns or exits."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run_cli([*argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def table_rows(out: str) -> dict[str, list[str]]:
    """Table rows keyed by layout name ("reserve-max 512", "paged B=16")."""
    rows = {}
    for line in out.splitlines():
        if line.startswith(("reserve-max", "paged")):
            name, rest = line.split("  ", 1)
            rows[name] = rest.split()
    return rows


def write_config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(fields))
    return path


# --- the seed's worked example ------------------------------------------------------------


def test_worked_example_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(SEED_ARGS, capsys)
    assert code == 0 and err == ""
    assert "useful positions: 968" in out
    assert "max-len: 512\n" in out
    rows = table_rows(out)
    assert rows["reserve-max 512"] == ["2560", "1592", "37.81%", "-", "-"]
    assert rows["paged B=16"] == ["992", "24", "97.58%", "62", "248"]
    assert rows["paged B=32"] == ["1024", "56", "94.53%", "32", "128"]
    header = next(line for line in out.splitlines() if line.startswith("layout"))
    for column in ("allocated", "wasted", "utilization", "block-table entries"):
        assert column in header
    assert "bytes per token" not in out  # no model shape, no bytes


def test_worked_example_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(SEED_ARGS, capsys)
    assert report == {
        "useful": 968,
        "layouts": [
            {
                "name": "reserve-max",
                "max_len": 512,
                "allocated": 2560,
                "wasted": 1592,
                "utilization": 968 / 2560,
            },
            {
                "name": "paged",
                "block_size": 16,
                "allocated": 992,
                "wasted": 24,
                "utilization": 968 / 992,
                "block_table_entries": 62,
            },
            {
                "name": "paged",
                "block_size": 32,
                "allocated": 1024,
                "wasted": 56,
                "utilization": 968 / 1024,
                "block_table_entries": 32,
            },
        ],
    }


def test_json_schema_types(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json([*SEED_ARGS, *LLAMA_8B], capsys)
    assert type(report["useful"]) is int and type(report["kv_bytes_per_token"]) is int
    common = {"name": str, "allocated": int, "wasted": int, "utilization": float}
    common |= {"allocated_bytes": int, "wasted_bytes": int, "useful_bytes": int}
    reserve, *paged = report["layouts"]
    assert set(reserve) == {*common, "max_len"}
    for layout in paged:
        assert set(layout) == {*common, "block_size", "block_table_entries", "block_table_bytes"}
    for layout in report["layouts"]:
        for key, kind in common.items():
            assert type(layout[key]) is kind, key
        assert 0 < layout["utilization"] <= 1


def test_defaults_block_size_16_and_max_len_longest(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["kv-calc", "--lengths", "37,91,128,201,511"], capsys)
    assert code == 0
    assert "max-len: 511 (default: the longest length" in out
    assert set(table_rows(out)) == {"reserve-max 511", "paged B=16"}
    report = run_json(["kv-calc", "--lengths", "37,91,128,201,511"], capsys)
    assert [layout.get("block_size") for layout in report["layouts"]] == [None, 16]
    assert report["layouts"][0]["max_len"] == 511


def test_lengths_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = tmp_path / "lengths.txt"
    lines.write_text("# constructed\n37\n91\n128\n201\n511\n")
    commas = tmp_path / "lengths.csv"
    commas.write_text("37,91,128, 201,511\n")
    for path in (lines, commas):
        argv = ["kv-calc", "--lengths-file", str(path), "--block-sizes", "16,32"]
        report = run_json([*argv, "--max-len", "512"], capsys)
        assert report == run_json(SEED_ARGS, capsys)


# --- bytes --------------------------------------------------------------------------------


def test_bytes_with_model_shape(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json([*SEED_ARGS, *LLAMA_8B], capsys)
    m_kv = 2 * 32 * 8 * 128 * 2
    assert report["kv_bytes_per_token"] == m_kv == 131072
    reserve, b16, b32 = report["layouts"]
    assert reserve["allocated_bytes"] == 2560 * m_kv
    assert reserve["wasted_bytes"] == 1592 * m_kv
    assert b16["useful_bytes"] == 968 * m_kv
    assert (b16["allocated_bytes"], b16["block_table_bytes"]) == (992 * m_kv, 62 * 4)
    assert (b32["wasted_bytes"], b32["block_table_bytes"]) == (56 * m_kv, 32 * 4)
    assert b16["utilization"] == 968 / 992  # block tables never folded in

    code, out, _ = run_cli([*SEED_ARGS, *LLAMA_8B], capsys)
    assert code == 0
    assert "= 131072 (128.0 KiB)" in out
    assert f"useful KV bytes: {968 * m_kv}" in out
    assert table_rows(out)["paged B=16"][-2:] == [str(992 * m_kv), str(24 * m_kv)]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(  # GQA, explicit head_dim, transformers 4 name for the dtype
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "head_dim": 128,
                "torch_dtype": "bfloat16",
            },
            2 * 32 * 8 * 128 * 2,
            id="gqa",
        ),
        pytest.param(  # MQA, head dim derived from hidden_size, transformers 5 dtype name
            {
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "num_key_value_heads": 1,
                "hidden_size": 2048,
                "dtype": "float32",
            },
            2 * 24 * 1 * 128 * 4,
            id="mqa",
        ),
        pytest.param(  # no num_key_value_heads: MHA, h_kv = num_attention_heads
            {
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "hidden_size": 768,
                "torch_dtype": "float16",
            },
            2 * 12 * 12 * 64 * 2,
            id="mha-default",
        ),
        pytest.param(  # multimodal: the language model under text_config
            {
                "text_config": {
                    "num_hidden_layers": 4,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 2,
                    "head_dim": 64,
                },
                "torch_dtype": "bfloat16",
            },
            2 * 4 * 2 * 64 * 2,
            id="text-config",
        ),
    ],
)
def test_model_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict, expected: int
) -> None:
    config = write_config(tmp_path / "model", **fields)
    for model in (config.parent, config):  # the directory or the file itself
        report = run_json([*SEED_ARGS, "--model", str(model)], capsys)
        assert report["kv_bytes_per_token"] == expected
        assert report["layouts"][1]["allocated_bytes"] == 992 * expected


def test_model_dtype_override_and_missing(tmp_path: Path, capsys) -> None:
    fields = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    config = write_config(tmp_path, **fields, torch_dtype="float32")
    report = run_json([*SEED_ARGS, "--model", str(config), "--dtype", "fp8"], capsys)
    assert report["kv_bytes_per_token"] == 2 * 2 * 4 * 64 * 1
    write_config(tmp_path, **fields)
    code, _, err = run_cli([*SEED_ARGS, "--model", str(tmp_path)], capsys)
    assert code == 2 and "no dtype / torch_dtype; pass --dtype" in err


# --- plot ---------------------------------------------------------------------------------


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "util.png"
    code, out, err = run_cli([*SEED_ARGS, "--plot", str(path)], capsys)
    assert code == 0, err
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    assert f"plot: {path}" in out

    json_path = tmp_path / "util-json.png"
    report = run_json([*SEED_ARGS, "--block-sizes", "24", "--plot", str(json_path)], capsys)
    assert report["layouts"][1]["block_size"] == 24  # stdout stays pure JSON
    assert json_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", ","], "--lengths: no values given"),
        (["--lengths", "37,0,5"], "--lengths: values must be >= 1, got 0"),
        (["--lengths=-4"], "--lengths: values must be >= 1, got -4"),
        (["--lengths", "37,x1"], "--lengths: 'x1' is not an integer"),
        (["--lengths", "5", "--block-sizes", "0"], "--block-sizes: values must be >= 1, got 0"),
        (["--lengths", "5", "--block-sizes", "1.5"], "--block-sizes: '1.5' is not an integer"),
        (["--lengths", "600", "--max-len", "512"], "length 600 exceeds --max-len 512"),
        (["--lengths", "5", "--max-len", "0"], "--max-len: must be >= 1, got 0"),
        (["--lengths", "5", "--max-len", "big"], "--max-len: expected an integer, got 'big'"),
        (
            ["--lengths", "5", *LLAMA_8B[:6], "--dtype", "float13"],
            "--dtype: unknown dtype 'float13'",
        ),
        (["--lengths", "5", "--layers", "2"], "needs --kv-heads, --head-dim, --dtype"),
        (["--lengths", "5", "--dtype", "fp16"], "--dtype needs a model shape"),
        (["--lengths", "5", "--head-dim", "-1"], "--head-dim: must be >= 1, got -1"),
        (["--lengths", "5", "--model", "/no/such/model"], "--model: no config.json at"),
        (["--lengths", "5", "--plot", "out.pdf"], "--plot writes a PNG"),
        (["--lengths", "5", "--plot", "/no/such/dir/u.png"], "--plot: cannot write"),
        (["--lengths-file", "/no/such/file"], "--lengths-file: cannot read /no/such/file"),
        ([], "one of the arguments --lengths --lengths-file is required"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["kv-calc", *argv], capsys)
    assert code == 2
    assert out == ""
    assert ERROR_PREFIX in err and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "cannot parse"),
        ("[1, 2]", "does not hold a JSON object"),
        ('{"num_attention_heads": 8, "hidden_size": 512}', "no num_hidden_layers / n_layer"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 0}', "must be an integer >= 1"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}', "divisible"),
        ('{"num_hidden_layers": "2", "num_attention_heads": 3}', "must be an integer >= 1"),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8, '
            '"torch_dtype": "auto"}',
            "config.json dtype: unknown dtype 'auto'",
        ),
        ('{"num_hidden_layers": 2, "kv_lora_rank": 512}', "MLA"),
    ],
)
def test_bad_config_exits_2(
    tmp_path: Path, config: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(config)
    code, out, err = run_cli(["kv-calc", "--lengths", "5", "--model", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert err.startswith(ERROR_PREFIX) and message in err


def test_bad_lengths_file_names_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("37\nabc\n")
    code, _, err = run_cli(["kv-calc", "--lengths-file", str(path)], capsys)
    assert code == 2 and f"--lengths-file {path}: 'abc' is not an integer" in err


def test_console_script(tmp_path: Path) -> None:
    assert CONSOLE_SCRIPT.exists(), CONSOLE_SCRIPT
    ok = subprocess.run(
        [str(CONSOLE_SCRIPT), *SEED_ARGS], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert table_rows(ok.stdout)["reserve-max 512"][:3] == ["2560", "1592", "37.81%"]
    bad = subprocess.run(
        [str(CONSOLE_SCRIPT), "kv-calc", "--lengths", "600", "--max-len", "512"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == f"{ERROR_PREFIX} length 600 exceeds --max-len 512"


def test_builtin_model_by_name(smollm2_tokenizer, capsys):
    """`--model smollm2-135m` reads the converted checkpoint's config (the fixture converted it)."""
    code, out, _ = run_cli(
        ["kv-calc", "--model", "smollm2-135m", "--lengths", "100", "--json"], capsys
    )
    assert code == 0
    model = json.loads(out)["model"]
    assert (model["num_layers"], model["num_kv_heads"], model["head_dim"]) == (30, 3, 64)
    assert model["dtype"] == "float32"


# --- the KV dtype (kv_cache_dtype) ---------------------------------------------------------


def test_kv_dtype_fp8_halves_bf16_and_reports_the_scales_apart(capsys) -> None:
    shape = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64"]
    base = ["kv-calc", "--lengths", "100", "--block-sizes", "16", *shape]
    bf16 = run_json([*base, "--dtype", "bfloat16"], capsys)
    fp8 = run_json([*base, "--dtype", "bfloat16", "--kv-dtype", "fp8"], capsys)
    assert bf16["kv_bytes_per_position"] == 2 * 30 * 3 * 64 * 2 == 2 * fp8["kv_bytes_per_position"]
    assert bf16["scale_bytes_per_position"] == 0
    assert fp8["scale_bytes_per_position"] == 2 * 30 * 3 * 4  # one float32 per row of K and V
    assert fp8["positions_per_gib"] == 2**30 // 11520 == 2 * bf16["positions_per_gib"]
    assert fp8["positions_per_gib_with_scales"] == 2**30 // (11520 + 720)
    assert fp8["model"]["kv_dtype"] == "fp8" and fp8["model"]["dtype_bytes"] == 1
    paged = fp8["layouts"][1]
    assert paged["allocated_bytes"] == 112 * 11520 and paged["scale_bytes"] == 112 * 720
    code, out, _ = run_cli([*base, "--dtype", "float32", "--kv-dtype", "fp8_e5m2"], capsys)
    assert code == 0
    assert "2*30*3*64*1 (float8_e5m2) = 11520" in out
    assert "scales 2*L*h_kv*4 = 720 bytes per position, counted apart (6.25% of M_KV)" in out
    assert "positions per GiB: 93206 (87724 with the scales)" in out


def test_kv_dtype_int8_counts_as_fp8_does(capsys) -> None:
    shape = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64"]
    base = ["kv-calc", "--lengths", "100", "--block-sizes", "16", *shape, "--dtype", "float32"]
    fp32 = run_json(base, capsys)
    int8 = run_json([*base, "--kv-dtype", "int8"], capsys)
    fp8 = run_json([*base, "--kv-dtype", "fp8"], capsys)
    assert int8["kv_bytes_per_position"] == 11520 == fp32["kv_bytes_per_position"] // 4
    for key in ("kv_bytes_per_position", "scale_bytes_per_position", "positions_per_gib"):
        assert int8[key] == fp8[key]
    assert int8["model"]["kv_dtype"] == "int8" and int8["model"]["dtype_bytes"] == 1
    code, out, _ = run_cli([*base, "--kv-dtype", "int8"], capsys)
    assert code == 0 and "2*30*3*64*1 (int8) = 11520" in out


def test_kv_dtype_needs_a_shape_and_a_known_name(capsys) -> None:
    code, _, err = run_cli(["kv-calc", "--lengths", "10", "--kv-dtype", "fp8"], capsys)
    assert code == 2 and "--kv-dtype needs a model shape" in err
    argv = ["kv-calc", "--lengths", "10", *LLAMA_8B, "--kv-dtype", "int4"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--kv-dtype" in err and "invalid choice" in err


# --- tensor parallelism: KV per rank ------------------------------------------------------


def test_tensor_parallel_reports_the_fullest_rank_s_bytes(capsys: pytest.CaptureFixture[str]):
    # 8 KV heads over 3 ranks: 3, 3, 2 heads; each device holds at most 3 heads' KV.
    report = run_json([*SEED_ARGS, *LLAMA_8B, "--tensor-parallel-size", "3"], capsys)
    assert report["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert report["kv_bytes_per_token_per_rank"] == 2 * 32 * 3 * 128 * 2
    code, out, _ = run_cli([*SEED_ARGS, *LLAMA_8B, "--tensor-parallel-size", "2"], capsys)
    assert code == 0 and "per rank (tensor parallel 2" in out and "= 65536 " in out


def test_more_ranks_than_kv_heads_is_refused(capsys: pytest.CaptureFixture[str]):
    code, _, err = run_cli([*SEED_ARGS, *LLAMA_8B, "--tensor-parallel-size", "9"], capsys)
    assert code == 2 and err.startswith(ERROR_PREFIX) and "--tensor-parallel-size 9" in err
