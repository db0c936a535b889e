"""scripts/gpu_probe.py: it refuses without CUDA, and its host-gather measure gathers the right rows."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_probe.py"


def load_probe():
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the probe would measure")
def test_without_cuda_it_refuses_and_writes_nothing(tmp_path):
    saved = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--save", str(saved)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
    assert not saved.exists()


def test_selected_rows_are_the_budget_of_each_head_in_its_own_rows():
    rows = load_probe().selected_rows(kv_heads=4, context=100, budget=0.15).view(4, -1)
    assert rows.shape == (4, 15)
    for head in range(4):
        assert rows[head].min() >= head * 100 and rows[head].max() < (head + 1) * 100
        assert rows[head].unique().numel() == 15


def test_host_gather_measures_a_correct_gather():
    rate = load_probe().measure_host_gather(kv_heads=2, head_dim=8, context=512, budget=0.15, threads=1, pin=False)
    assert rate > 0


def test_the_mapped_gather_measures_the_engines_zero_copy_fetch():
    """The same function a card runs with CudaOps, here over the CPU's threaded ops: it gathers the right rows
    (it checks them itself) and reports a rate."""
    from infinigen_core.transfer import ThreadedCpuOps

    ops = ThreadedCpuOps()
    try:
        assert load_probe().measure_mapped_gather(ops, kv_heads=2, head_dim=8, context=256, budget=0.15,
                                                  dtype=torch.float32, repeats=1) > 0
    finally:
        ops.close()
