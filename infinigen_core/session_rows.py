"""What an engine gives a saved session and takes back from it: its rows, their signature, their partial keys.

A mixin of `InfiniGenEngine` (as pool_restore.py is of the pool): it reads and writes the engine's pool, policy
and token ids, but is one job apart from running steps. The row format itself is rows.py's.

    rows = engine.export_rows(0, 512, partial_keys=True)   # a chunk of the conversation, CPU tensors
    engine.kv_signature()                                  # what the chunk must match to be read back
    engine.import_rows([rows])                             # appended after the tokens held, no model run
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .rows import export_rows, held_partial_keys, import_rows, stored_partial_keys

HeldPartialKeys = tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict[int, str]]


class SessionRows:
    """Export, import and signature of a conversation's rows (see the module docstring); the attributes are
    InfiniGenEngine's."""

    @torch.inference_mode()
    def export_rows(self, start: int, end: int, partial_keys: bool = False) -> dict[str, torch.Tensor]:
        """K/V rows of positions [start, end) per layer, plus their token ids, as CPU tensors (see rows.py); with
        `partial_keys` also the policy's partial keys of those rows, where it keeps them (`partial_key_digests`
        says for which layers, and what they were made with)."""
        self.fetcher.flush()
        export = self.policy.export_partial_keys if partial_keys else None
        return export_rows(self.pool, self.token_ids, start, end, export)

    def partial_key_digests(self) -> dict[int, str]:
        """Per layer whose partial keys `export_rows` gives, a digest of what they depend on besides the keys
        (the layer's skewed channels): saved partial keys are reusable where the digest is the same."""
        return self.policy.partial_key_digests()

    @torch.inference_mode()
    def import_rows(self, chunks: Iterable[dict[str, torch.Tensor]]) -> int:
        """Restore exported chunks (in order) after the current tokens, rebuilding partial keys; no model run.

        A chunk's K/V are in any dtype or int8 codes with their scales (rows.py); either way they are written
        straight into the pool's slots, the pool sized once for all the chunks. Partial keys a chunk carries
        (`pk.L`, made where `partial_key_digests` are this engine's: the caller checks) are taken as they are;
        the others are recomputed from the keys.
        """
        self.fetcher.flush()
        chunks = list(chunks)
        restored = import_rows(self.pool, self.token_ids, chunks)
        self.policy.rebuild(stored_partial_keys(chunks, self.adapter.num_layers))
        self.fetcher.rebuild()
        return restored

    def legacy_kv_signatures(self) -> list[dict[str, str]]:
        """The signatures earlier versions wrote for this very pool (the model under an older fingerprint)."""
        return [{**self.kv_signature(), "model_fingerprint": old} for old in self.legacy_fingerprints]

    def kv_signature(self) -> dict[str, str]:
        """What a saved pool must match to be reused."""
        skew = self.skew_set.fingerprint() if self.skew_set is not None else "none"
        adapter = self.adapter
        return {"model_fingerprint": self.fingerprint, "dtype": str(self.dtype).replace("torch.", ""),
                "num_layers": str(adapter.num_layers), "num_kv_heads": str(adapter.num_kv_heads),
                "head_dim": str(adapter.head_dim), "skew": skew}

    def _held_partial_keys(self) -> HeldPartialKeys:
        """Before a settings change: the policy's partial keys of every slot, and the digests they were made
        with (a restored pool's keys may be int8-rounded, so the keys it was restored with are worth keeping)."""
        if self.pool is None:
            return {}, {}
        return held_partial_keys(self.pool, self.policy), self.partial_key_digests()

    def _keep_held_partial_keys(self, held: HeldPartialKeys) -> None:
        """After a settings change: the new policy takes the held partial keys of the layers whose digest stayed."""
        carried, digests = held
        new_digests = self.policy.partial_key_digests()
        carried = {layer: keys for layer, keys in carried.items() if new_digests.get(layer) == digests[layer]}
        if carried:
            self.policy.rebuild(carried)
