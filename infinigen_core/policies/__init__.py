"""KV policies behind one interface; adding one is a new file and one line here."""

from .base import KVPolicy, PolicyContext, Selection
from .full import FullPolicy
from .h2o import H2OPolicy
from .infinigen import InfiniGenPolicy
from .offload import OffloadPolicy
from .streaming import StreamingPolicy

POLICIES: dict[str, type[KVPolicy]] = {
    policy.name: policy for policy in (FullPolicy, OffloadPolicy, InfiniGenPolicy, H2OPolicy, StreamingPolicy)
}

__all__ = ["KVPolicy", "PolicyContext", "Selection", "POLICIES"]
