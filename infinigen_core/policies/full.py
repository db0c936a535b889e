"""Dense attention over the whole cache, kept on the compute device: the accuracy reference."""

from .base import KVPolicy


class FullPolicy(KVPolicy):
    name = "full"
    keeps_pool_on_device = True

    def is_sparse(self, layer: int) -> bool:
        return False
