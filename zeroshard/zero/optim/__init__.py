"""ZeRO's optimizer states: the optimizer that steps this rank's chunk of the fp32
masters (``optimizer``: clipping, the non-finite check, the loss scale) and the states
kept in memory (``memory_store``; offload/ holds the swapped and delayed ones).
"""
