"""`bench gpu`'s whole flow on the CPU under CUDA's rules (--emulate): the rows it writes, and when.

conftest runs this file under the separate-devices mode: prefill under `full`, the policy switched over
the filled pool, decoding from host memory through the streamed fetch, as on a GPU.
"""

import gzip
import json

import pytest

from bench.cli import main
from bench.gpu import SHAPES, TRACED_STEPS, gpu_benchmark
from bench.gpu_predict import PROFILES, predict_step

CONTEXT, STEPS = 96, 2


def test_emulated_flow_writes_a_row_per_policy(tmp_path, capsys):
    saved = tmp_path / "gpu.json"
    assert main(["gpu", "--emulate", "--context", str(CONTEXT), "--decode-tokens", str(STEPS),
                 "--budgets", "0.2", "--save", str(saved)]) in (0, None)
    result = json.loads(saved.read_text())
    assert result["emulated"] is True and result["cuda"] is False
    rows = {row["policy"]: row for row in result["rows"]}
    assert set(rows) == {"full", "offload", "infinigen"}  # hf-offload needs CUDA: left out
    for row in rows.values():
        assert row["context"] == CONTEXT and row["ms_per_token"] > 0 and row["tokens_per_s"] > 0
    per_token = 2 * 2 * 32 * 4  # K and V, 2 KV heads, head_dim 32, float32: one token of one layer
    # the fair baseline keeps the whole layers that fit in InfiniGen's KV memory (fetch.resident_layer_set): its
    # 2 dense layers + partial keys (0.5 layer) + gather buffers (0.4 layer) hold 2 layers; the other 2 whole, new
    # token included: 97, 98 tokens
    assert rows["offload"]["bytes_fetched_per_token"] == 2 * (2 * CONTEXT + 3) / 2 * per_token
    assert rows["infinigen"]["fetch"] == "zero-copy" and rows["offload"]["fetch"] is None
    assert rows["full"]["bytes_fetched_per_token"] == 0
    assert 0 < rows["infinigen"]["bytes_fetched_per_token"] < rows["offload"]["bytes_fetched_per_token"]
    assert rows["infinigen"]["ratio_to_full"] == pytest.approx(rows["full"]["ms_per_token"]
                                                               / rows["infinigen"]["ms_per_token"])
    # host work per step: InfiniGen writes and gathers in place (one copy to the host: its statistics, no worker
    # call); the fair offload uploads its 2 whole layers through the worker; `full` moves nothing
    host_work = {policy: (row["host_copies_per_step"], row["worker_calls_per_step"]) for policy, row in rows.items()}
    assert host_work == {"full": (0, 0), "offload": (0, 2), "infinigen": (1, 0)}


def test_rows_are_saved_as_they_are_measured(tmp_path):
    """A run cut short (the device's time limit) keeps every row measured before."""
    saved = tmp_path / "gpu.json"

    def stop_after_offload(message):
        if message.lstrip().startswith("offload"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gpu_benchmark(["tiny"], [CONTEXT], ["full", "offload", "infinigen"], [0.2], STEPS, stop_after_offload,
                      save=saved, emulate=True)
    assert [row["policy"] for row in json.loads(saved.read_text())["rows"]] == ["full", "offload"]


def test_the_predictor_counts_the_bytes_the_engine_moves():
    """The predicted table describes this code: per policy, the bytes it says a decode step moves are the
    engine's own count in the emulated run of the benchmark's flow (one step at the context)."""
    rows = gpu_benchmark(["tiny"], [CONTEXT], ["full", "offload", "infinigen"], [0.2, 0.1], 1, lambda _: None,
                         emulate=True)["rows"]
    assert len(rows) == 4
    for row in rows:
        budget = row["budget"] if row["policy"] == "infinigen" else 0.2  # offload: run under the first budget
        predicted = predict_step(SHAPES["tiny"], CONTEXT, row["policy"], budget, PROFILES["h100"], element_bytes=4)
        assert predicted["bytes_fetched_per_token"] == row["bytes_fetched_per_token"], row["policy"]


def test_rows_say_which_step_and_a_trace_is_written(tmp_path):
    """--compile is recorded (under the checks the step stays eager, and the header says why); --trace leaves a
    Chrome trace and the top ops of one step per policy."""
    saved, traces = tmp_path / "gpu.json", tmp_path / "trace"
    assert main(["gpu", "--emulate", "--context", str(CONTEXT), "--decode-tokens", str(STEPS), "--budgets", "0.2",
                 "--policies", "full,infinigen", "--compile", "default", "--trace", str(traces),
                 "--save", str(saved)]) in (0, None)
    result = json.loads(saved.read_text())
    assert result["compile"] == "default" and "separate-devices" in result["eager_reason"]
    assert {row["step"] for row in result["rows"]} == {"eager decode"}
    assert sorted(path.name for path in traces.iterdir()) == sorted(
        f"tiny-llama-gqa-{CONTEXT}-{policy}.{suffix}" for policy in ("full", "infinigen") for suffix in ("json.gz", "txt"))
    stem = f"tiny-llama-gqa-{CONTEXT}-infinigen"
    with gzip.open(traces / f"{stem}.json.gz", "rt") as trace:
        events = json.load(trace)["traceEvents"]
    assert any(event.get("name") == "aten::scaled_dot_product_attention" for event in events)
    # consecutive steps after a warm-up, each labelled: the warm-up is not in the trace
    steps = {event["name"] for event in events if event.get("name", "").startswith("decode step")}
    assert steps == {f"decode step {number}" for number in range(1, TRACED_STEPS + 1)}
    summary = (traces / f"{stem}.txt").read_text()
    assert f"{TRACED_STEPS} consecutive steps recorded" in summary and "sorted by self_cpu_time_total" in summary
