"""What would break a CUDA graph's replay of a decode step, found on the CPU (bench/capture_rules.py,
scripts/capture_check.py, docs/CAPTURE.md)."""

import importlib.util
import sys
from pathlib import Path

import torch

from bench.capture_rules import StepRecorder, differences, summary

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "capture_check.py"
_spec = importlib.util.spec_from_file_location("capture_check", _SCRIPT)
capture_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = capture_check  # a dataclass looks its module up there
_spec.loader.exec_module(capture_check)


def two_steps(step, *inputs_per_step):
    recorded = []
    for inputs in inputs_per_step:
        recorder = StepRecorder()
        with recorder:
            step(*inputs)
        recorded.append(recorder.ops)
    return differences(*recorded)


def test_each_kind_of_step_a_graph_could_not_replay_is_named():
    weights, buffer = torch.randn(4, 4), torch.zeros(1, 4)
    static = lambda x: torch.relu(x @ weights).sum()  # noqa: E731
    buffer.copy_(torch.ones(1, 4))
    assert two_steps(static, (buffer,), (buffer,)) == []  # a buffer refilled in place: replays
    assert two_steps(lambda x: x.exp(), (torch.ones(3),), (torch.ones(3),))[0].kind == "storage"  # a new input each step
    grows = two_steps(lambda x: (x @ weights).sum(), (torch.ones(5, 4),), (torch.ones(6, 4),))
    assert {d.kind for d in grows} == {"shape"}
    moved = two_steps(lambda x, start: x.narrow(0, start, 2).exp(), (buffer.expand(8, 4), 1), (buffer.expand(8, 4), 3))
    assert [d.kind for d in moved] == ["scalar"]
    branches = two_steps(lambda x, flag: x.exp() if flag else x.neg(), (buffer, True), (buffer, False))
    assert [d.kind for d in branches] == ["ops"]
    made_inside = two_steps(lambda x: (x.to(torch.float64) * 2).sum(), (buffer,), (buffer,))  # `to` copies: its own memory
    assert made_inside == []
    row = torch.zeros(8, 4)
    moved_view = two_steps(lambda x: x.exp(), (row[1:3],), (row[3:5],))  # one buffer, another place in it
    assert [d.kind for d in moved_view] == ["storage"]

    def hands_off(x):  # work given to another thread, noted by the step
        recorder.note("side.gather", x)

    smaller, larger = torch.ones(2), torch.ones(3)
    recorder = StepRecorder()
    with recorder:
        hands_off(smaller)
    first = recorder.ops
    recorder = StepRecorder()
    with recorder:
        hands_off(larger)
    assert [(d.name, d.kind) for d in differences(first, recorder.ops)] == [("side.gather", "shape")]


def test_the_forward_of_a_decode_step_reads_no_new_tensor_of_the_host_side_from_step_to_step():
    """The engine's one-token forward on the GPU's paths (INFINIGEN_SEPARATE_DEVICES): its token, position and slot
    come in fixed buffers (CAPTURE.md piece 1), the new rows go to the pool at those slots (piece 4), so what is
    left between two steps is what reads the pool over its size or selects over the past (pieces 2 and 3): shapes
    and slice bounds, never a tensor made anew outside the forward, never another op."""
    for policy in ("full", "infinigen"):
        recorded = capture_check.recorded_steps(policy, context=120)
        kinds = summary(differences(*recorded.steps))
        assert set(kinds) <= {"shape", "scalar"}, (policy, kinds)
        if policy == "full":  # every difference is the attention's read over the pool's size
            names = {name for counts in kinds.values() for name in counts}
            assert names <= {"aten.slice.Tensor", "aten.unsqueeze.default", "aten.scaled_dot_product_attention.default"}
        else:  # the new rows written and the selected rows gathered by the compute side itself (CAPTURE.md piece 4):
            # one copy to the host a step (its statistics), nothing handed to the fetch worker
            assert {name for name in map(lambda op: op.name, recorded.steps[0])} >= {"ops.scatter", "ops.gather"}
            assert (recorded.copies_to_host, recorded.worker_handoffs) == (1, 0)
