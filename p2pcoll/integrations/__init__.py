"""Bridges from other frameworks onto p2pcoll's groups (:mod:`.torch`: a torch.distributed
backend)."""
