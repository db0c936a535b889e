"""From one layer's normalised attention input to the next layer's: the input norms' gains swapped.

InfiniGen rehearses layer i+1's query from layer i's attention input. In a pre-norm model that input is
layer i's input norm applied to the residual stream, `normalised(r) * g_i + b_i` (RMSNorm: no b; Gemma
writes its gain as `1 + w`); layer i+1 applies its own norm, with its own gains, to nearly the same residual.
Fed as it is, the rehearsal sees every hidden channel scaled by layer i's gain where layer i+1 would use
its own: on Gemma 3 270M the ratio of the two spans 0.07-1.5 across channels. The bridge undoes it:

    x -> (x - b_i) * g_{i+1} / g_i + b_{i+1}

which is exact when the residual does not change between the two layers (the rest is the rehearsal's own
approximation). The gains are read off the norm modules by probing them, not from their weights, so every
parametrisation (`w`, `1 + w`, a bias or none) is covered by one rule. A family without an input norm
(OLMo 2/3 normalise after attention; OPT-350m after too) needs no bridge.
"""

from __future__ import annotations

import torch


def norm_affine(norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gain, shift) [size], float32: norm(x) = normalised(x) * gain + shift, up to one constant factor of the
    gain shared by every norm of the same kind (eps). None where it cannot be read: a norm without weights
    (nothing to tell apart), an odd size.

    The probe v = (1, -1, 1, -1, ...) has mean 0 and root mean square 1, so both LayerNorm and RMSNorm leave
    it as it is before their affine part: norm(v) = v * gain + shift and norm(-v) = -v * gain + shift."""
    parameter = next(norm.parameters(), None)
    if parameter is None or parameter.dim() != 1 or parameter.numel() % 2:
        return None
    dtype = parameter.dtype if parameter.is_floating_point() else torch.float32
    probe = torch.ones(parameter.numel(), device=parameter.device)
    probe[1::2] = -1.0
    with torch.no_grad():
        plus = norm(probe.to(dtype)).float()
        minus = norm((-probe).to(dtype)).float()
    return (plus - minus) / (2 * probe), (plus + minus) / 2


def input_bridge(source: torch.nn.Module | None,
                 target: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, offset) [size], float32, such that `x * scale + offset` turns `source`'s output into what
    `target` gives for the same input; None where nothing needs changing or nothing can be said."""
    if source is None or target is None or source is target:
        return None
    read_source, read_target = norm_affine(source), norm_affine(target)
    if read_source is None or read_target is None or read_source[0].shape != read_target[0].shape:
        return None
    (gain, shift), (target_gain, target_shift) = read_source, read_target
    if torch.equal(gain, target_gain) and torch.equal(shift, target_shift):
        return None
    # a channel the source norm zeroes carries nothing: the target's offset is all there is to say about it
    usable = gain.abs() > gain.abs().max() * 1e-6
    scale = torch.where(usable, target_gain / torch.where(usable, gain, torch.ones_like(gain)), torch.zeros_like(gain))
    return scale, target_shift - shift * scale
