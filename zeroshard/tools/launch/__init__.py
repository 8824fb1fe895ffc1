"""`zeroshard run`: the launcher over torchrun's agent (``launcher``), where ranks go
(``layout``: hostfile, filters, the node layout) and the bootstrap every worker runs
under (``worker``). This package imports nothing: ``worker`` starts before torch.
"""
