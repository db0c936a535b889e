"""The benchmark tools measure what they claim: exact checks on a tiny model, a short real-model run, the CLI."""

import json
import math
import subprocess
import sys

import pytest
import torch

from bench import cli
from bench.agree import agreement
from bench.common import EvalError, format_table, load_prefix, parse_policies, read_text, to_json, windows
from bench.ppl import perplexity
from bench.recall import attention_recall
from bench.speed import decode_speed
from bench.sweep import choose_defaults, sweep
from bench.weights import compare_weights
from infinigen_core import EngineConfig
from infinigen_core.calibration import calibration_text
from infinigen_core.weights import decode_weight_kinds

from conftest import make_tiny_engine, random_tokens

CONTEXT = 160
PREFILL = 128


@pytest.fixture
def tiny_engine(tiny_llama):
    engine = make_tiny_engine(tiny_llama)
    yield engine
    engine.close()


def configs(*policies, **settings):
    settings.setdefault("min_fetch_tokens", 0)  # short tiny-model contexts: budgets as fractions, no floor
    return {name: EngineConfig(policy=name, **settings) for name in policies}


def test_full_perplexity_equals_the_plain_model_on_the_scored_tokens(tiny_llama, tiny_engine):
    window = random_tokens(CONTEXT, seed=3)
    result = perplexity(tiny_engine, [window], PREFILL, configs("full", "offload"))
    model = tiny_llama[0]
    with torch.inference_mode():
        tiny_engine.model.set_attn_implementation("sdpa")
        try:
            logits = model(input_ids=torch.tensor([window])).logits[0]
        finally:
            tiny_engine.model.set_attn_implementation("infinigen")
    # logits[i] predicts token i+1: the scored tokens are window[PREFILL+1:], predicted from PREFILL on
    nll = torch.nn.functional.cross_entropy(logits[PREFILL:-1], torch.tensor(window[PREFILL + 1 :]))
    assert result["full"]["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert result["offload"]["ppl"] == pytest.approx(result["full"]["ppl"], rel=1e-4)
    assert result["full"]["scored_tokens"] == CONTEXT - PREFILL - 1
    assert result["full"]["fetched_ratio"] == 1.0 and result["offload"]["fetched_ratio"] == 1.0
    assert tiny_engine.num_tokens == 0  # the tools leave the engine empty


def test_a_small_budget_fetches_less_and_changes_perplexity(tiny_engine):
    window = random_tokens(CONTEXT, seed=4)
    result = perplexity(tiny_engine, [window], PREFILL, configs("full", "streaming", "infinigen", budget=0.1, alpha=1e9))
    for name in ("streaming", "infinigen"):
        # two dense layers of four read everything, the two sparse ones about a tenth
        assert result[name]["sparse_fetched_ratio"] == pytest.approx(0.1, abs=0.02)
        assert result[name]["fetched_ratio"] == pytest.approx((2 + 2 * 0.1) / 4, abs=0.02)
        assert result[name]["ppl"] != pytest.approx(result["full"]["ppl"], rel=1e-6)


def test_prefill_is_shared_except_with_h2o_which_learns_from_it(tiny_engine):
    prefix = random_tokens(PREFILL, seed=5)
    assert load_prefix(tiny_engine, EngineConfig(policy="full"), prefix) > 0
    assert load_prefix(tiny_engine, EngineConfig(policy="infinigen"), prefix) == 0.0  # cached K/V reused
    assert load_prefix(tiny_engine, EngineConfig(policy="h2o"), prefix) > 0
    assert float(tiny_engine.policy.scores[2].sum()) > 0  # heavy-hitter scores came from this prefill
    assert load_prefix(tiny_engine, EngineConfig(policy="streaming"), prefix) > 0
    assert tiny_engine.token_ids == prefix


def test_agreement_of_full_with_itself_is_perfect_and_a_tiny_budget_is_not(tiny_engine):
    prompt = random_tokens(PREFILL, seed=6)
    result = agreement(tiny_engine, [prompt], 12, configs("full", "streaming", budget=2, budget_is_tokens=True))
    assert result["full"]["agreement"] == 1.0 and result["full"]["match_prefix"] == 12
    assert result["streaming"]["agreement"] < 1.0
    assert result["streaming"]["match_prefix"] < 12


def test_recall_is_complete_when_everything_is_fetched_and_partial_otherwise(tiny_engine):
    ids = random_tokens(PREFILL + 6, seed=7)
    # a budget covering the context attends densely and measures nothing; the selecting path is what is measured
    everything = attention_recall(tiny_engine, ids[:PREFILL], ids[PREFILL:],
                                  configs("infinigen", budget=1.0, alpha=1e9, dense_under_budget=False))
    assert sorted(everything["infinigen"]["per_layer"]) == [2, 3]  # the sparse layers only
    assert everything["infinigen"]["recall"] == pytest.approx(1.0, abs=1e-4)
    # one budget for every layer: a random model's attention curves are noise, and spreading by them only
    # moves rows between its two sparse layers (budget_shares.py), which is not what this compares
    small = attention_recall(tiny_engine, ids[:PREFILL], ids[PREFILL:],
                             configs("streaming", "infinigen", budget=0.1, alpha=1e9, budget_by_layer=False))
    for name in ("streaming", "infinigen"):
        assert 0 < small[name]["recall"] < 0.95
    # the sink+recent window misses what a random model attends to; speculation finds more of it
    assert small["infinigen"]["recall"] > small["streaming"]["recall"]


def test_speed_rows_compare_every_policy_with_full_in_the_same_run(tiny_engine):
    ids = random_tokens(PREFILL + 12, seed=8)
    messages: list[str] = []
    rows = decode_speed(tiny_engine, ids, PREFILL, configs("full", "offload", "infinigen"), decode_tokens_n=6, rounds=2,
                        progress=messages.append)
    assert [row["policy"] for row in rows] == ["full", "offload", "infinigen", "transformers"]  # hf-offload: GPU only
    order = [message.rsplit(", ", 1)[1] for message in messages if "round" in message]
    assert order == ["full", "offload", "infinigen", "offload", "infinigen", "full"]  # each round starts one later
    by_policy = {row["policy"]: row for row in rows}
    assert by_policy["full"]["ratio_to_full"] == 1.0
    for row in rows:
        assert row["ms_per_token"] > 0 and row["decode_steps"] == 6  # timed steps; the warm-up step after each switch is extra
        assert row["ratio_to_full"] == pytest.approx(row["ms_per_token"] / by_policy["full"]["ms_per_token"])
        assert row["pool_bytes"] > 0
    assert by_policy["infinigen"]["fetched_ratio"] < 1.0
    assert by_policy["infinigen"]["speculate_ms"] > 0 and by_policy["full"]["speculate_ms"] == 0
    assert by_policy["full"]["prefill_s"] > 0
    for row in rows:  # every row says what one step launches and how often it would stall a GPU
        assert row["ops_per_step"] > 0
        if row["policy"] != "transformers":
            assert row["syncs_per_step"] == 0, row
            assert row["peak_rss_bytes"] > 1_000_000  # the process's peak so far, in bytes (Linux gives kB)
    assert by_policy["infinigen"]["host_copies_per_step"] == 1 and by_policy["full"]["host_copies_per_step"] == 0
    with pytest.raises(EvalError, match="tokens are needed"):
        decode_speed(tiny_engine, ids[:PREFILL], PREFILL, configs("full"), decode_tokens_n=6)
    with pytest.raises(EvalError, match="exceeds the model's window"):
        decode_speed(tiny_engine, random_tokens(1100), 1022, configs("full"), decode_tokens_n=6)


def test_weights_rows_run_in_the_same_rounds_and_the_model_ends_as_it_was_loaded(tiny_engine, monkeypatch):
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)  # the tiny model's layers are small
    ids = random_tokens(PREFILL + 12, seed=11)
    runs = {**configs("full"), "full+int4": configs("full")["full"], "full+fp32": configs("full")["full"]}
    rows = decode_speed(tiny_engine, ids, PREFILL, runs, decode_tokens_n=4, rounds=2, reference=False)
    assert [row["policy"] for row in rows] == ["full", "full+int4", "full+fp32"]
    assert all(row["decode_steps"] == 4 and row["ops_per_step"] > 0 for row in rows)
    assert decode_weight_kinds(tiny_engine.model) == {}  # loaded fp32: fp32 again after


def test_compare_weights_scores_every_kind_against_fp32_on_the_same_tokens(tiny_engine, monkeypatch):
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    window = random_tokens(CONTEXT, seed=12)
    result = compare_weights(tiny_engine, [window], PREFILL, ["int8", "fp32", "int4"], EngineConfig(policy="full"),
                             new_tokens=4)
    assert list(result) == ["fp32", "int8", "int4"]  # the reference first, once
    fp32 = result["fp32"]
    assert (fp32["ppl_vs_fp32"], fp32["agreement"], fp32["max_logit_diff"], fp32["match_prefix"]) == (0, 1, 0, 4)
    assert fp32["ppl"] == pytest.approx(perplexity(tiny_engine, [window], PREFILL, configs("full"))["full"]["ppl"], rel=1e-6)
    for kind in ("int8", "int4"):
        row = result[kind]
        assert 0 < row["max_logit_diff"] < 0.5 and abs(row["ppl_vs_fp32"]) < 0.05 and row["agreement"] >= 0.8
        assert row["scored_tokens"] == CONTEXT - PREFILL - 1
    assert decode_weight_kinds(tiny_engine.model) == {} and tiny_engine.num_tokens == 0


def test_sweep_covers_the_grid_and_choose_defaults_takes_the_cheapest_within_tolerance(tiny_engine):
    window = random_tokens(CONTEXT, seed=9)
    rows = sweep(tiny_engine, [window], PREFILL, alphas=[1.0, 1e9], budgets=[0.1, 0.5], partial_ratios=[0.25, 0.5])
    assert len(rows) == 1 + 2 * 2 * 2 and rows[0]["policy"] == "full" and rows[0]["ppl_vs_full"] == 0.0
    assert {(r["alpha"], r["budget"], r["partial_ratio"]) for r in rows[1:]} == {
        (a, b, p) for a in (1.0, 1e9) for b in (0.1, 0.5) for p in (0.25, 0.5)}
    synthetic = [{"policy": "full", "ppl_vs_full": 0.0, "fetched_ratio": 1.0},
                 {"policy": "infinigen", "ppl_vs_full": 0.005, "fetched_ratio": 0.3},
                 {"policy": "infinigen", "ppl_vs_full": 0.009, "fetched_ratio": 0.2},
                 {"policy": "infinigen", "ppl_vs_full": 0.05, "fetched_ratio": 0.1}]
    assert choose_defaults(synthetic, 0.01) is synthetic[2]
    assert choose_defaults(synthetic, 0.001) is None


def test_text_helpers(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "skip.md").write_text("not text", encoding="utf-8")
    assert read_text(tmp_path) == "first\n\nsecond"
    with pytest.raises(EvalError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "bad.bin").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(EvalError, match="not UTF-8"):
        read_text(tmp_path / "bad.bin")
    assert windows(list(range(100)), 30, 2) == [list(range(30)), list(range(50, 80))]
    assert len(windows(list(range(100)), 30, 9)) == 3
    with pytest.raises(EvalError, match="fewer than one window"):
        windows(list(range(10)), 30, 1)
    with pytest.raises(EvalError, match="unknown policy fast"):
        parse_policies("full,fast")
    table = format_table([{"policy": "full", "ppl": 12.3456}, {"policy": "h2o", "ppl": float("nan")}], ["policy", "ppl"])
    assert table.splitlines()[2] == "| full   | 12.35 |" and table.splitlines()[3] == "| h2o    | -     |"
    assert json.loads(to_json({"ppl": float("nan"), "rows": [1.5]})) == {"ppl": None, "rows": [1.5]}


def test_bad_input_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def refuse(args):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr(cli, "_load_engine", refuse)
    assert cli.main(["ppl", "--text", str(tmp_path / "missing.txt"), "--context", "512"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["ppl", "--text", str(tmp_path), "--context", "512", "--policies", "full,magic"]) == 2
    assert "unknown policy magic" in capsys.readouterr().err
    assert cli.main(["sweep", "--text", str(tmp_path), "--alphas", "5", "--budgets", "1.5"]) == 2
    assert "budget" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run for real")
def test_gpu_benchmark_without_cuda_says_so_and_exits_cleanly():
    done = subprocess.run([sys.executable, "-m", "bench", "gpu", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "no CUDA device: the GPU benchmark needs one, nothing was measured"
    result = json.loads(lines[-1])
    assert result["cuda"] is False and result["rows"] == [] and result["command"] == "gpu"


# ------------------------------------------------------------------------------------------- real model
def test_ppl_cli_on_the_real_model(real_engine, tmp_path, capsys, monkeypatch):
    """The shipped calibration text, 320 tokens: the JSON's shape, and the sparse policies fetch a fraction."""
    text = tmp_path / "text.txt"
    text.write_text(calibration_text(), encoding="utf-8")
    monkeypatch.setattr(cli, "_load_engine", lambda args: real_engine)  # the session's one real engine
    saved = tmp_path / "out" / "ppl.json"
    code = cli.main(["ppl", "--text", str(text), "--context", "320", "--prefill", "288",
                     "--policies", "full,infinigen,streaming", "--min-fetch-tokens", "0", "--json", "--save", str(saved)])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(saved.read_text())
    full, infinigen = result["full"], result["infinigen"]
    assert 1 < full["ppl"] < 100  # a trained model on English prose
    assert full["fetched_ratio"] == 1.0 and full["ppl_vs_full"] == 0.0
    # 28 of 30 layers sparse at a 15% budget (no floor); accuracy at this tiny context is the benchmarks' business
    assert infinigen["fetched_ratio"] < 0.3 and result["streaming"]["fetched_ratio"] < 0.3
    assert math.isfinite(infinigen["ppl"]) and infinigen["ppl"] != full["ppl"]
    assert all(result[name]["ms_per_token"] > 0 and result[name]["scored_tokens"] == 31 for name in result
               if isinstance(result[name], dict) and "ppl" in result[name])


def test_resume_benchmark_on_the_real_model(real_engine):
    from bench.common import EvalError
    from bench.resume import resume_versus_reprefill

    result = resume_versus_reprefill(real_engine, 384, ppl_tokens=16)
    assert 250 < result["tokens"] <= 384 + 64
    assert [(row["format"], row["cold"]) for row in result["rows"]] == [("int8", True), ("int8", False),
                                                                          ("exact", True), ("exact", False)]
    for row in result["rows"]:
        assert row["resume_s"] > 0 and row["reprefill_s"] > 0
        assert row["speedup"] == pytest.approx(row["reprefill_s"] / row["resume_s"])
    int8, exact = result["rows"][0], result["rows"][2]
    assert result["format"] == "int8" and result["cold"] is True  # the default format, cold, at the top level
    # float16 keys and int8 values (30 x 3 x 64 x 3 bytes, a float16 scale per value row, the token id: 17,468)
    assert 17_468 < int8["disk_bytes_per_token"] <= 17_700 < 46_000 < exact["disk_bytes_per_token"]
    assert exact["resumed_ppl_delta"] == pytest.approx(0.0, abs=1e-4)  # an exact resume changes nothing
    assert abs(int8["resumed_ppl_delta"]) < 0.05
    assert real_engine.num_tokens == 0
    with pytest.raises(EvalError, match="unknown KV format"):
        resume_versus_reprefill(real_engine, 384, formats=("zip",))


def test_plots_from_saved_results(tiny_engine, tmp_path):
    from bench.plots import make_plots
    from bench.ppl import with_ratio_to_full

    ids = random_tokens(CONTEXT, seed=10)
    saved = {
        "ppl2k.json": {"context": CONTEXT, **with_ratio_to_full(perplexity(tiny_engine, [ids], PREFILL, configs("full", "streaming")))},
        "recall.json": {"context": PREFILL, **attention_recall(tiny_engine, ids[:PREFILL], ids[PREFILL:PREFILL + 3], configs("infinigen", "h2o"))},
        "speed.json": {"rows": decode_speed(tiny_engine, ids, PREFILL, configs("full", "infinigen"), 2, 1)},
        "sweep.json": {"context": CONTEXT, "rows": sweep(tiny_engine, [ids], PREFILL, [1e9], [0.2, 0.5], [0.25]), "chosen": None},
    }
    for name, result in saved.items():
        (tmp_path / name).write_text(to_json(result))
    made = make_plots(tmp_path, tmp_path / "plots")
    assert sorted(p.name for p in made) == ["ppl.png", "recall.png", "speed.png", "sweep.png"]
    for path in made:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_random_llama_from_meta_is_fully_initialised():
    """The GPU benchmark's model builder, on the CPU with a small shape: no uninitialised memory left."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from bench.gpu import ModelShape, random_llama

    shape = ModelShape("small", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=100, rope_theta=500000.0)
    model = random_llama(shape, 256, device="cpu", dtype=torch.float32)
    assert model.config.num_key_value_heads == 2 and model.config.max_position_embeddings >= 256
    fresh = LlamaRotaryEmbedding(model.config)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.inv_freq)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    weights = model.model.layers[0].self_attn.q_proj.weight
    assert 0.01 < float(weights.std()) < 0.03  # drawn from N(0, 0.02), not leftover memory
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_gpu_rows_get_their_ratios_within_the_same_model_and_context():
    from bench.gpu import add_ratios

    rows = [{"model": "m", "context": 4096, "policy": p, "tokens_per_s": t}
            for p, t in (("full", 40.0), ("offload", 4.0), ("hf-offload", 5.0), ("infinigen", 20.0))]
    rows.append({"model": "m", "context": 8192, "policy": "infinigen", "tokens_per_s": 10.0})
    add_ratios(rows)
    infinigen = rows[3]
    assert infinigen["speedup_vs_offload"] == 5.0 and infinigen["speedup_vs_hf_offload"] == 4.0
    assert infinigen["ratio_to_full"] == 0.5
    assert rows[4]["speedup_vs_offload"] is None  # nothing to compare with at 8k
