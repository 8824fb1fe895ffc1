"""The flat layout of ZeRO: which elements of which parameters each rank owns
(``partition``), the segments a flat buffer is cut into (gradient buckets at stages 0-2,
module units at stage 3; ``segments``), and the flat parameter buffer with its views
(``flat``). No communication.
"""
